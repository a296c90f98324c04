"""A sliced job's step (engine.slices): one task per slice, the slices in parallel across the
workers, the step committed once every slice of it is stored.

1. Whoever starts applying step t (the apply_step task, under the step's claim) writes the
   step's plan once, keyed by the state t it applies to: the cover of stored results (one
   cover of the tree, engine.tree.choose) that every slice reads, and the nonce the slices of
   state t+1 are stored under. Every slice reads the same results, so a shard uploaded twice
   (a backup) cannot give two slices two different devices' bits.
2. It sends each slice not yet done to the `steps` queue, under a per-slice claim that
   expires (a lost task is sent again when reconcile next finds the step complete), and
   applies one slice itself.
3. A slice task reads its slice of state t and its range of each result in the plan, applies
   engine.step.apply_step(part=...), stores its slice of state t+1 under the plan's nonce and
   marks itself done. A slice applied twice writes the same bits under the same key: a slice
   that fails or whose worker dies is applied again alone.
4. The task that finds every slice done commits the step: the guarded commit of a whole
   step (scheduler.tasks.commit), guarded by state t's nonce too; the loser of a race
   changes nothing and deletes nothing (the slices are the winner's too).

A result of the plan that is gone (the replica holding its body died) deletes the plan with
the result: its shards are to do again, and the next complete upload plans the step afresh
under a new nonce. Slices stored under the old one are never named by a commit (it checks the
plan it completes is still the step's) and go with the step's keys.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, replace

import numpy as np

from domain.store.models import Job
from domain.task_metrics import observe_task
from engine.jobinfo import JobInfo, job_info_or_reason
from engine.optim import STATE_SLOTS
from engine.step import ShardResult, StepMetrics, TrainState
from engine.step import apply_step as engine_apply_step
from engine.tree import choose
from hotstate import keys
from hotstate.bodies import Piece, fetch_pieces
from hotstate.gradstore import GradBlobError, Ref, read_ref, stored_nodes, unpack
from hotstate.recent import RECENT_SLICES
from hotstate.sliceplan import SlicePlan
from hotstate.trainstate import StateBlob, state_stored
from hotstate.version import bump_version
from scheduler.celery_app import app
from scheduler.checkpoints import write_checkpoint
from scheduler.context import SchedulerContext, get_context
from scheduler.tasks.commit import Outcome, checkpoint_every, checkpoint_failed, commit_step
from scheduler.tasks.recovery import (
    drop_step_keys,
    ensure_state,
    load_slice,
    load_state,
    slice_name,
)
from wire.states import JobState

log = logging.getLogger(__name__)


@app.task(name="scheduler.apply_slice", acks_late=True, reject_on_worker_lost=True)
def apply_slice(job_id: str, step: int, index: int) -> str:
    """Idempotent: a slice applied twice, or on two workers at once, stores the same bits."""
    started, ok = time.perf_counter(), False
    try:
        outcome = run_apply_slice(get_context(), job_id, int(step), int(index))
        ok = True
        return outcome
    finally:
        observe_task("apply_slice", time.perf_counter() - started, ok)


def run_sliced_step(ctx: SchedulerContext, job: Job, info: JobInfo) -> str:
    """Start (or resume) applying a sliced job's current step: plan it, send the slices not
    done to the workers, apply one here."""
    step = job.step
    if not state_stored(ctx.blobs, job.id, step, job.state_nonce, len(info.slices)):
        now = _job(ctx, job.id)  # committed meanwhile (its keys dropped): nothing to restore
        if now is None or (now.step, now.state_nonce) != (step, job.state_nonce):
            return Outcome.STALE
        state = ensure_state(ctx, job, info)  # lost hot state: restored, maybe rewound
        if state is None or state.step != step:
            return Outcome.STALE
        job = _job(ctx, job.id) or job  # the restore named a new nonce
        if job.step != step:
            return Outcome.STALE
    plan = _plan(ctx, job, info, create=True)
    if plan is None:
        return Outcome.INCOMPLETE
    todo = _not_done(ctx, job, info, plan)
    if not todo:  # every slice stored, the commit not (its task died): commit now
        return _commit(ctx, job, info, plan, None)
    if ctx.tuning.slices_inline:
        outcomes = [run_apply_slice(ctx, job.id, step, index) for index in todo]
        return outcomes[-1]
    for index in todo[1:]:
        if ctx.blobs.set_if_absent(keys.slice_claim(job.id, step, plan.nonce, index), b"1",
                                   ttl=ctx.tuning.apply_claim_ttl_s):
            send_slice(job.id, step, index)
    return run_apply_slice(ctx, job.id, step, todo[0])


def send_slice(job_id: str, step: int, index: int) -> None:
    apply_slice.apply_async((job_id, step, index), queue="steps")


def _not_done(ctx: SchedulerContext, job: Job, info: JobInfo, plan: SlicePlan) -> list[int]:
    """The plan's slices to apply: not marked done, or marked done with their stored state
    gone since (a key lost alone: its mark goes, and the slice is applied again)."""
    todo = []
    for i in range(len(info.slices)):
        done = keys.slice_done(job.id, job.step, plan.nonce, i)
        if not ctx.blobs.exists(done):
            todo.append(i)
        elif not ctx.blobs.exists(keys.state_slice(job.id, job.step + 1, plan.nonce, i)):
            ctx.blobs.delete(done)
            todo.append(i)
    return todo


def _job(ctx: SchedulerContext, job_id: str) -> Job | None:
    with ctx.session_factory() as session:
        job = session.get(Job, job_id)
        if job is not None:
            session.expunge(job)
        return job


def _plan(ctx: SchedulerContext, job: Job, info: JobInfo, create: bool) -> SlicePlan | None:
    """The step's plan; made (first writer wins) when `create` and every shard is stored."""
    key = keys.slice_plan(job.id, job.step, job.state_nonce)
    plan = SlicePlan.decode(ctx.blobs.get(key))
    if plan is not None or not create:
        return plan
    chosen = choose(stored_nodes(ctx.blobs, job.id, job.step, info.spec.shards),
                    info.spec.shards)
    if chosen is None:
        return None
    ctx.blobs.set_if_absent(key, SlicePlan(keys.new_nonce(), tuple(chosen)).encode())
    return SlicePlan.decode(ctx.blobs.get(key))


def run_apply_slice(ctx: SchedulerContext, job_id: str, step: int, index: int) -> str:
    job = _job(ctx, job_id)
    if job is None:
        return Outcome.GONE
    if job.state != JobState.RUNNING or job.step != step:
        return Outcome.STALE
    info, _ = job_info_or_reason(job.id, job.spec, ctx.settings.data_dir)
    if info is None or index >= len(info.slices):
        return Outcome.STALE  # the step's own task fails the job with the reason
    plan = _plan(ctx, job, info, create=False)
    if plan is None:
        return Outcome.INCOMPLETE  # replanned after a lost result: the new plan's tasks apply it
    done = keys.slice_done(job.id, step, plan.nonce, index)
    if ctx.blobs.exists(done):
        return _commit(ctx, job, info, plan, None)
    state = load_slice(ctx, job.id, step, job.state_nonce, index)
    if state is None:
        now = _job(ctx, job.id)  # a late task: the step may be committed (its keys dropped)
        if now is not None and (now.step, now.state_nonce) == (step, job.state_nonce):
            ensure_state(ctx, now, info)  # lost: restores every slice (and rewinds)
        return Outcome.STALE
    part = info.slices[index]
    results = _slice_results(ctx, job, info, plan, part)
    if results is None:
        return Outcome.INCOMPLETE
    lo, hi = part
    blob = StateBlob(step + 1, hi - lo, info.model.n_buffers if lo == 0 else 0,
                     len(STATE_SLOTS[info.spec.optimizer]))
    new_state, metrics = engine_apply_step(info.model, info.spec, state, results,
                                           workers=ctx.tuning.apply_threads,
                                           out=(blob.params, blob.opt_state, blob.buffers),
                                           part=part)
    ctx.blobs.set(keys.state_slice(job.id, step + 1, plan.nonce, index), blob.data)
    RECENT_SLICES.remember(slice_name(job.id, index), new_state, plan.nonce)
    if ctx.tuning.apply_pause_s:
        time.sleep(ctx.tuning.apply_pause_s)  # tests: widen the crash window on purpose
    ctx.blobs.set(done, json.dumps(asdict(metrics)).encode())  # the step's, for its commit
    bump_version(ctx.blobs, keys.SLICES_VERSION)  # phones waiting for this slice take it now
    return _commit(ctx, job, info, plan, metrics)


def _slice_results(ctx: SchedulerContext, job: Job, info: JobInfo, plan: SlicePlan,
                   part: tuple[int, int]) -> list[ShardResult] | None:
    """The plan's results, their gradients cut to the slice: only those bytes are read from
    the replicas holding the uploads (hotstate.bodies.fetch_pieces), and the batch statistics
    only by the slice that carries the buffers (the others add zeros: they apply no buffers).
    None when a result is gone or broken: then the plan goes too (the step is planned again
    once those shards are uploaded again)."""
    lo, hi = part
    n_params, n_stats = info.model.n_params, info.model.n_stats
    stats_here = n_stats if lo == 0 else 0
    names = [keys.grad(job.id, job.step, a, b - a) for a, b in plan.cover]
    stored = ctx.blobs.get_many(names)
    # each result: a whole one (stored in the blob store itself), or where its slice's
    # pieces sit in the upload it references
    held: list[tuple[tuple[int, int], str, ShardResult | tuple[Ref, Piece, Piece | None]]] = []
    broken = []
    for node, name, data in zip(plan.cover, names, stored):
        try:
            if data is None:
                raise GradBlobError("gone")
            ref = read_ref(data, n_params, n_stats)
            held.append((node, name, unpack(data, n_params, n_stats) if ref is None
                         else (ref, *_pieces(ref, part, stats_here))))
        except GradBlobError:
            broken.append(name)
    pieces = fetch_pieces(ctx.blobs, [p for _, _, h in held if isinstance(h, tuple)
                                      for p in h[1:] if p is not None])
    results = []
    no_stats = np.zeros(n_stats, np.float32)
    for (a, b), name, h in held:
        if isinstance(h, ShardResult):
            results.append(replace(h, shard=a, span=b - a, grad_sum=h.grad_sum[lo:hi]))
            continue
        ref, grad_piece, stats_piece = h
        grad = pieces.get(grad_piece)
        stats = pieces.get(stats_piece) if stats_piece else no_stats
        if grad is None or stats is None:
            broken.append(name)
            continue
        results.append(ShardResult(a, np.frombuffer(grad, "<f4"), ref.loss_sum, ref.correct,
                                   ref.count, np.frombuffer(stats, "<f4"), b - a))
    if broken:
        _forget_plan(ctx, job, info, plan, {n: d for n, d in zip(names, stored) if n in broken})
        return None
    return results


def _pieces(ref: Ref, part: tuple[int, int], n_stats: int) -> tuple[Piece, Piece | None]:
    """Where a slice's gradient range and (n_stats > 0) the batch statistics sit in a body."""
    grad = (ref.body_key, (ref.grad_offset + 4 * part[0], ref.grad_offset + 4 * part[1]))
    stats = (ref.body_key, (ref.stats_offset, ref.stats_offset + 4 * n_stats)) if n_stats \
        else None
    return grad, stats


def _forget_plan(ctx: SchedulerContext, job: Job, info: JobInfo, plan: SlicePlan,
                 broken: dict[str, bytes | memoryview | None]) -> None:
    """The plan's broken results (as read) and the plan itself go: their devices upload
    those shards again and the step is planned afresh. Only what this task read is deleted:
    a slower task of the same plan must not delete a result uploaded again meanwhile, nor
    the plan made after it."""
    log.warning("step %d of %s: %d result(s) of its plan are gone; replanned once uploaded "
                "again", job.step, job.id, len(broken))
    for name, data in broken.items():
        if data is not None:
            ctx.blobs.delete_if_equal(name, bytes(data))
    if ctx.blobs.delete_if_equal(keys.slice_plan(job.id, job.step, job.state_nonce),
                                 plan.encode()):
        claims = [keys.slice_claim(job.id, job.step, plan.nonce, i)
                  for i in range(len(info.slices))]
        ctx.blobs.delete(keys.apply_claim(job.id, job.step), *claims)


def _commit(ctx: SchedulerContext, job: Job, info: JobInfo, plan: SlicePlan,
            metrics: StepMetrics | None) -> str:
    """Commit the step if every slice of the plan is stored and the plan is still the step's."""
    step, slices = job.step, len(info.slices)
    marks = [keys.slice_done(job.id, step, plan.nonce, i) for i in range(slices)]
    if ctx.blobs.count_existing(marks) < slices:
        return Outcome.APPLIED  # this slice is; the last one to finish commits
    if not state_stored(ctx.blobs, job.id, step + 1, plan.nonce, slices):
        return Outcome.INCOMPLETE  # a slice's state lost after its mark: reapplied (_not_done)
    if _plan(ctx, job, info, create=False) != plan:
        return Outcome.STALE  # replanned meanwhile: the new plan's slices commit
    final = step + 1 >= info.total_steps
    due = final or (step + 1) % checkpoint_every(ctx, job) == 0
    whole = load_state(ctx, job.id, step + 1, plan.nonce, info.slices) if due else None
    if due and whole is None:
        return Outcome.INCOMPLETE  # a slice's state lost meanwhile: applied again (_not_done)
    if metrics is None:  # a commit resumed after its task died: its marks hold the metrics
        metrics = _marked_metrics(ctx.blobs.get_many(marks))
        if metrics is None:
            return Outcome.INCOMPLETE
    new_state = whole or TrainState(step + 1, np.zeros(0, np.float32), np.zeros(0, np.float32),
                                    np.zeros(0, np.float32))
    ckpt = None
    if due and whole is not None:
        try:
            ckpt = write_checkpoint(ctx.settings.artifacts_dir, job.id, info.model, whole)
        except OSError as exc:
            checkpoint_failed(ctx, job, step + 1, exc, final)
            if final:
                return Outcome.RETRY
    if not commit_step(ctx, job, info, metrics, new_state, ckpt, final, plan.nonce,
                       from_nonce=job.state_nonce):
        return Outcome.STALE
    drop_step_keys(ctx, job.id, keep_state=step + 1)
    bump_version(ctx.blobs)
    # then phones waiting for a slice of step + 1 look again (their API reads the new rows)
    bump_version(ctx.blobs, keys.SLICES_VERSION)
    return Outcome.APPLIED


def _marked_metrics(marks: list[bytes | None]) -> StepMetrics | None:
    """The step's metrics as a slice's done mark holds them (every slice's are the same: the
    plan's results' losses and counts, added up the tree)."""
    for data in marks:
        if data is None:
            continue
        try:
            return StepMetrics(**json.loads(data))
        except (ValueError, TypeError):
            continue
    return None
