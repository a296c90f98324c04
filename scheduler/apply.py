"""The apply pipeline: one range of a job's step t (the whole parameter vector, or one slice of
it) read, computed and stored; the step committed and published once every range of it is
stored. scheduler.tasks.steps runs it for a whole step, scheduler.tasks.slices once per slice:
the sequence is written here once, the range its parameter.

    plan     the results every range adds (one cover of the tree, engine.tree.choose), once
             their audits agree (scheduler.audits.verify: until then INCOMPLETE), and the
             nonce state t+1 is stored under: a whole step's plan is its apply's own, a sliced
             step's is stored once (first writer wins) and read by each slice's task
    read     state t's range (restored, the job maybe rewound, when the blob store lost it)
             and each planned result cut to the range
    compute  engine.step.apply_step(part=range): the results added up the canonical tree and
             the update, the reference trainer's function; a whole step's weights message takes
             each block of the new weights on the thread that just wrote it
    store    the range of state t+1 under the plan's nonce (STATE_WRITERS: a whole step's write
             overlaps its message, its checkpoint and its rows); a slice is then marked done
    commit   once every range is stored: the checkpoint when due, then in one transaction the
             guarded UPDATE jobs SET step=t+1, state_nonce=<plan's nonce> WHERE id=:id AND
             step=t (a sliced step: AND state_nonce=<state t's>), the step's metrics, what
             its audits found (domain.store.audits), the checkpoint's row and the step
             boundary (`StepBoundary`, the extension point the caller hands in: placement's
             moves at the boundary commit with the step); the final step's validation is
             measured first and committed with it (the job's result)
    publish  the long polls woken (the version bumped), then step t's keys dropped; every
             `eval_every` steps the validation split is run on state t+1 (engine.validation,
             as the reference trainer does) and its point written on the step's row: the
             phones compute step t+1 meanwhile

What a crash or a race anywhere leaves is repeated or repaired, never corrupt:
- state t+1 is stored under a nonce no row names until the commit names it: a crash between
  the store and the commit leaves step t current and an unnamed state (dropped with the step's
  keys); the retry recomputes and commits its own;
- the loser of a race (or a retry after the commit) matches no row and changes nothing;
  readers follow the row's nonce, so a whole step's loser, which may have computed from other
  results (a shard recomputed meanwhile), is never read whenever it wrote, and it deletes its
  state; a sliced step's loser deletes nothing (the slices are the winner's too);
- a range applied twice stores the same bits under the same key (the plan fixes its inputs);
- a result that is broken, or whose upload body is gone, is deleted (as read: never one
  uploaded again since) with the step's claim, and a sliced step's plan with its slices'
  claims: its devices upload again and the next complete upload applies the step at once;
- a checkpoint that cannot be written (a full disk) is a warning and training goes on, but the
  final step is not committed without it (RETRY): applied again when the claim expires.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Protocol

import numpy as np
from sqlalchemy import select, update
from sqlalchemy.orm import Session

from domain.store import events
from domain.store.db import transaction
from domain.store.jobs import JobAssignments, job_assignments
from domain.store.models import Event, Job, StepMetric
from domain.store.states import Event as StateEvent
from domain.store.states import transition, update_job
from engine.data import load_dataset
from engine.jobinfo import JobInfo
from engine.optim import STATE_SLOTS
from engine.runner import final_metrics
from engine.slices import Bounds
from engine.step import ShardResult, StepMetrics, TrainState
from engine.step import apply_step as engine_apply_step
from engine.tree import choose
from engine.validation import ValidationPoint, validate, validation_due
from hotstate import keys
from hotstate.bodies import Piece, fetch_bodies, fetch_pieces
from hotstate.gradstore import GradBlobError, Ref, body_key_of, read_ref, stored_nodes, unpack
from hotstate.recent import RECENT, RECENT_SLICES
from hotstate.sliceplan import SlicePlan
from hotstate.trainstate import StateBlob, state_stored
from hotstate.version import bump_version
from scheduler import audits, store_ops
from scheduler.checkpoints import (
    WrittenCheckpoint,
    prune_checkpoints,
    remove_files,
    write_checkpoint,
)
from scheduler.context import SchedulerContext
from scheduler.tasks.recovery import (
    drop_job_keys,
    drop_step_keys,
    ensure_state,
    load_slice,
    load_state,
    slice_name,
)
from wire.messages import WeightsMessage
from wire.states import JobState

log = logging.getLogger(__name__)

# writes a range's new state while a whole step's weights message is sealed and its rows are
# written; kept for the process (a thread started per step cost the step ~1 ms on its critical
# path). Its threads start only when needed: the limit is above any worker's concurrency, so no
# apply's write waits behind another's (the commit waits for it holding the job's row)
STATE_WRITERS = ThreadPoolExecutor(max_workers=32, thread_name_prefix="state-write")


class Outcome:
    APPLIED = "applied"
    STALE = "stale"
    GONE = "gone"
    INCOMPLETE = "incomplete"
    FAILED = "failed"
    RETRY = "retry"  # not committed on purpose: applied again when the claim expires


class StepBoundary(Protocol):
    """What happens to a job's shards at a step boundary, called inside the step's commit after
    its rows (its changes commit with the step or not at all); never at the final step, whose
    commit releases the shards. The tasks hand in scheduler.tasks.boundary.at_step_boundary."""

    def __call__(self, ctx: SchedulerContext, session: Session, job: Job, new_step: int,
                 now: dt.datetime, held: JobAssignments) -> None: ...


@dataclass(frozen=True)
class Applied:
    """One range of step t applied: its part of state t+1, being written under `key`."""

    state: TrainState
    metrics: StepMetrics
    key: str
    storing: Future[None]
    weights: bytes | memoryview | None  # a whole step's weights message of step t+1


def run_range(ctx: SchedulerContext, job: Job, info: JobInfo, index: int,
              boundary: StepBoundary, plan: SlicePlan | None = None) -> str:
    """Range `index` of step job.step applied under `plan` (a whole step: None, its plan is
    made once its state is read) and stored; the step committed if every range is stored."""
    state = read_state(ctx, job, info, index)
    if state is None:
        return Outcome.STALE
    plan = plan or plan_step(ctx, job, info)
    if plan is None:
        return Outcome.INCOMPLETE
    results = read_results(ctx, job, info, plan, index)
    if results is None:
        return Outcome.INCOMPLETE
    applied = apply_range(ctx, job, info, plan, index, state, results)
    if len(info.slices) > 1:
        mark_applied(ctx, job, plan, index, applied)
    return commit_step(ctx, job, info, plan, boundary, applied)


# -- plan -------------------------------------------------------------------------------------

def plan_step(ctx: SchedulerContext, job: Job, info: JobInfo) -> SlicePlan | None:
    """The step's plan, None until every shard's result is stored: a whole step's made here
    for this apply alone; a sliced step's read, or made and stored (first writer wins)."""
    sliced = len(info.slices) > 1
    if sliced and (plan := stored_plan(ctx, job)) is not None:
        return plan
    chosen = choose(stored_nodes(ctx.blobs, job.id, job.step, info.spec.shards),
                    info.spec.shards)
    if chosen is None:
        return None
    audited = audits.verify(ctx, job, info, chosen) if info.spec.audited else audits.Audited()
    if audited is None:  # a result that needs an audit is not yet checked
        return None
    plan = SlicePlan(keys.new_nonce(), tuple(chosen), audited.agreed, audited.unaudited)
    if not sliced:
        return plan
    ctx.blobs.set_if_absent(keys.slice_plan(job.id, job.step, job.state_nonce), plan.encode())
    return stored_plan(ctx, job)


def stored_plan(ctx: SchedulerContext, job: Job) -> SlicePlan | None:
    """A sliced step's plan, as stored for state t (None: not made, or forgotten)."""
    return SlicePlan.decode(ctx.blobs.get(keys.slice_plan(job.id, job.step, job.state_nonce)))


# -- read -------------------------------------------------------------------------------------

def read_state(ctx: SchedulerContext, job: Job, info: JobInfo, index: int) -> TrainState | None:
    """State t's range `index`; None when the job is no longer at it. A whole state the blob
    store lost is restored here (in place, or the job rewound to its checkpoint: then None);
    a lost slice restores every slice (the state renamed: this task's plan is void)."""
    if len(info.slices) == 1:
        state = ensure_state(ctx, job, info)
        return state if state is not None and state.step == job.step else None
    state = load_slice(ctx, job.id, job.step, job.state_nonce, index)
    if state is None:  # a late task finds the step committed (its keys dropped): no restore
        ensure_state(ctx, job, info)
    return state


def read_results(ctx: SchedulerContext, job: Job, info: JobInfo, plan: SlicePlan,
                 index: int) -> list[ShardResult] | None:
    """The plan's results cut to range `index`; None when one is gone or broken (then
    forgotten: `forget_results`)."""
    names = [keys.grad(job.id, job.step, lo, hi - lo) for lo, hi in plan.cover]
    stored = ctx.blobs.get_many(names)
    if len(info.slices) == 1:
        results, broken = _whole_results(ctx, info, plan, names, stored)
    else:
        results, broken = _range_results(ctx, info, plan, names, stored, info.slices[index])
    if broken:
        forget_results(ctx, job, info, plan, {n: d for n, d in zip(names, stored) if n in broken})
        return None
    return results


def _whole_results(ctx: SchedulerContext, info: JobInfo, plan: SlicePlan, names: list[str],
                   stored: list[bytes | None]) -> tuple[list[ShardResult], list[str]]:
    """Each result whole, as views of the stored uploads (hotstate.bodies: this process's, the
    other replicas', or the blob store's); the names of those broken or gone."""
    refs = [_body_key(data) for data in stored]
    bodies = fetch_bodies(ctx.blobs, sorted({ref for ref in refs if ref}))
    results, broken = [], []
    for (lo, hi), name, data, ref in zip(plan.cover, names, stored, refs):
        try:  # a malformed reference (ref None) fails here too
            if data is None:
                raise GradBlobError("gone")
            result = unpack(data, info.model.n_params, info.model.n_stats,
                            bodies.get(ref) if ref else None)
            results.append(replace(result, shard=lo, span=hi - lo))  # the key names the range
        except GradBlobError:
            broken.append(name)
    return results, broken


def _body_key(data: bytes | memoryview | None) -> str | None:
    try:
        return body_key_of(data) if data is not None else None
    except GradBlobError:
        return None


def _range_results(ctx: SchedulerContext, info: JobInfo, plan: SlicePlan, names: list[str],
                   stored: list[bytes | None], part: Bounds
                   ) -> tuple[list[ShardResult], list[str]]:
    """Each result's gradient cut to the slice: only those bytes are read from the replicas
    holding the uploads (hotstate.bodies.fetch_pieces), and the batch statistics only by the
    slice that carries the buffers (the others add zeros: they apply no buffers)."""
    lo, hi = part
    n_params, n_stats = info.model.n_params, info.model.n_stats
    stats_here = n_stats if lo == 0 else 0
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
    return results, broken


def _pieces(ref: Ref, part: Bounds, n_stats: int) -> tuple[Piece, Piece | None]:
    """Where a slice's gradient range and (n_stats > 0) the batch statistics sit in a body."""
    grad = (ref.body_key, (ref.grad_offset + 4 * part[0], ref.grad_offset + 4 * part[1]))
    stats = (ref.body_key, (ref.stats_offset, ref.stats_offset + 4 * n_stats)) if n_stats \
        else None
    return grad, stats


def forget_results(ctx: SchedulerContext, job: Job, info: JobInfo, plan: SlicePlan,
                   broken: dict[str, bytes | memoryview | None]) -> None:
    """Broken results (as read) go, with the step's claim: their devices see those shards as to
    do again, and the upload that completes the step enqueues it at once, not after the
    claim's TTL. A sliced step's plan goes too (if still this one), so the step is planned
    afresh. Only what this task read is deleted: a slower task must not delete a result
    uploaded again meanwhile, nor the plan made after it."""
    log.warning("step %d of %s: %d result(s) are gone or broken; applied once uploaded again",
                job.step, job.id, len(broken))
    for name, data in broken.items():
        if data is not None:
            ctx.blobs.delete_if_equal(name, bytes(data))
    if len(info.slices) == 1:
        ctx.blobs.delete(keys.apply_claim(job.id, job.step))
    elif ctx.blobs.delete_if_equal(keys.slice_plan(job.id, job.step, job.state_nonce),
                                   plan.encode()):
        claims = [keys.slice_claim(job.id, job.step, plan.nonce, i)
                  for i in range(len(info.slices))]
        ctx.blobs.delete(keys.apply_claim(job.id, job.step), *claims)


# -- compute and store ------------------------------------------------------------------------

def apply_range(ctx: SchedulerContext, job: Job, info: JobInfo, plan: SlicePlan, index: int,
                state: TrainState, results: list[ShardResult]) -> Applied:
    """The update of range `index`, written straight into the blob it is stored as (params,
    optimizer state, buffers: the buffers ride in the range starting at 0), its write started.
    A whole step's weights message (the API serves it as made) takes each block of the new
    params, and its checksum, on the thread that just wrote it (in its cache: not one more pass
    over the vector), and is sealed while the state is written."""
    whole = len(info.slices) == 1
    lo, hi = info.slices[index]
    n_buffers = info.model.n_buffers if lo == 0 else 0
    blob = StateBlob(job.step + 1, hi - lo, n_buffers, len(STATE_SLOTS[info.spec.optimizer]))
    message = WeightsMessage(job.id, job.step + 1, hi - lo, n_buffers) if whole else None
    new_state, metrics = engine_apply_step(
        info.model, info.spec, state, results, workers=ctx.tuning.apply_threads,
        out=(blob.params, blob.opt_state, blob.buffers), part=None if whole else (lo, hi),
        done=None if message is None else partial(message.take_params, blob.params))
    key = (keys.state(job.id, job.step + 1, plan.nonce) if whole
           else keys.state_slice(job.id, job.step + 1, plan.nonce, index))
    # the row will name the nonce: the state is stored before the commit can (it waits)
    storing = STATE_WRITERS.submit(ctx.blobs.set, key, blob.data)
    weights = None
    if message is not None:
        message.buffers[:] = blob.buffers  # both only read the blob meanwhile
        weights = message.seal()
    return Applied(new_state, metrics, key, storing, weights)


def mark_applied(ctx: SchedulerContext, job: Job, plan: SlicePlan, index: int,
                 applied: Applied) -> None:
    """A slice stored, then marked done with the step's metrics (for whoever commits): a slice
    whose task dies before its mark is applied again alone; phones waiting for it take it."""
    applied.storing.result()
    RECENT_SLICES.remember(slice_name(job.id, index), applied.state, plan.nonce)
    if ctx.tuning.apply_pause_s:
        time.sleep(ctx.tuning.apply_pause_s)  # tests: widen the crash window on purpose
    ctx.blobs.set(keys.slice_done(job.id, job.step, plan.nonce, index),
                  json.dumps(asdict(applied.metrics)).encode())
    bump_version(ctx.blobs, keys.SLICES_VERSION)


# -- commit and publish -----------------------------------------------------------------------

def commit_step(ctx: SchedulerContext, job: Job, info: JobInfo, plan: SlicePlan,
                boundary: StepBoundary, applied: Applied | None = None) -> str:
    """Commit step t under `plan` if every range of it is stored: `applied`, this task's range
    (a whole step's is waited for inside the commit); None: a sliced step's commit made from
    its marks (the task that stored the last slice died before committing)."""
    step = job.step
    final = step + 1 >= info.total_steps
    due = final or (step + 1) % checkpoint_every(ctx, job) == 0
    validated = validation_due(info.spec, step + 1)
    stored = _step_stored(ctx, job, info, plan, applied, due or validated)
    if isinstance(stored, str):
        return stored
    new_state, metrics = stored
    # the final point is part of the job's result: measured before its commit; any other
    # after the publish, so the phones compute step t+1 meanwhile (a large validation split
    # takes seconds, and the claim on the step expires after apply_claim_ttl_s)
    point = _validation_point(ctx, info, new_state) if validated and final else None
    ckpt = None
    if due:
        try:
            ckpt = write_checkpoint(ctx.settings.artifacts_dir, job.id, info.model, new_state)
        except OSError as exc:
            checkpoint_failed(ctx, job, step + 1, exc, final)
            if final:  # the job's result: not done without it; applied again when the claim
                _drop_unnamed(ctx, info, applied)  # expires, e.g. once space is freed
                return Outcome.RETRY
    try:
        committed = commit_rows(ctx, job, info, plan, metrics, new_state, ckpt, final, boundary,
                                applied.storing if applied else None, point)
    finally:
        if applied is not None:
            wait([applied.storing])  # whatever the commit did, the write is over
    if not committed:
        _drop_unnamed(ctx, info, applied)  # never named: nobody reads it
        return Outcome.STALE
    publish(ctx, job, info, plan, applied, final)
    if validated and not final:
        record_validation(ctx, job.id, plan.nonce, metrics.step,
                          _validation_point(ctx, info, new_state))
    return Outcome.APPLIED


def _validation_point(ctx: SchedulerContext, info: JobInfo, state: TrainState
                      ) -> ValidationPoint | None:
    """The validation of `state` (engine.validation, as the reference trainer computes it)."""
    data = load_dataset(info.spec.dataset, ctx.settings.data_dir)
    return validate(info, state, data.x_val, data.y_val)


def record_validation(ctx: SchedulerContext, job_id: str, nonce: str, step: int,
                      point: ValidationPoint | None) -> None:
    """Step `step`'s point on its row, and in the job's metrics while the job still stands on
    the state it was measured on (`nonce`); a rewind since deleted the row: nothing is
    written."""
    if point is None:
        return
    values = {"val_loss": point.val_loss, "val_accuracy": point.val_accuracy}
    with transaction(ctx.session_factory) as session:
        session.execute(update(StepMetric).where(StepMetric.job_id == job_id,
                                                 StepMetric.step == step).values(**values))
        metrics = session.scalar(select(Job.metrics).where(Job.id == job_id))
        update_job(session, job_id, expect={"step": step + 1, "state_nonce": nonce,
                                            "state": JobState.RUNNING.value},
                   metrics={**(metrics or {}), **values})


def _step_stored(ctx: SchedulerContext, job: Job, info: JobInfo, plan: SlicePlan,
                 applied: Applied | None, due: bool) -> tuple[TrainState, StepMetrics] | str:
    """State t+1 (whole when `due`: a checkpoint is written or the validation run from it)
    and the step's metrics, once every range is stored under `plan`; otherwise the outcome to
    return."""
    if len(info.slices) == 1 and applied is not None:
        return applied.state, applied.metrics
    step, slices = job.step, len(info.slices)
    marks = [keys.slice_done(job.id, step, plan.nonce, i) for i in range(slices)]
    if ctx.blobs.count_existing(marks) < slices:
        return Outcome.APPLIED  # this slice is; the last one to finish commits
    if not state_stored(ctx.blobs, job.id, step + 1, plan.nonce, slices):
        return Outcome.INCOMPLETE  # a slice's state lost after its mark: applied again
    if stored_plan(ctx, job) != plan:
        return Outcome.STALE  # replanned meanwhile: the new plan's slices commit
    whole = load_state(ctx, job.id, step + 1, plan.nonce, info.slices) if due else None
    if due and whole is None:
        return Outcome.INCOMPLETE  # a slice's state lost meanwhile: applied again
    metrics = applied.metrics if applied else _marked_metrics(ctx.blobs.get_many(marks))
    if metrics is None:
        return Outcome.INCOMPLETE
    empty = np.zeros(0, np.float32)
    return whole or TrainState(step + 1, empty, empty, empty), metrics


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


def _drop_unnamed(ctx: SchedulerContext, info: JobInfo, applied: Applied | None) -> None:
    """A whole step's state no committed row names: deleted once its write has ended, whatever
    its end. A sliced step's stay (another task's commit may still name them)."""
    if len(info.slices) == 1 and applied is not None:
        wait([applied.storing])
        ctx.blobs.delete(applied.key)


def commit_rows(ctx: SchedulerContext, job: Job, info: JobInfo, plan: SlicePlan,
                m: StepMetrics, new_state: TrainState, ckpt: WrittenCheckpoint | None,
                final: bool, boundary: StepBoundary, storing: Future[None] | None,
                point: ValidationPoint | None = None) -> bool:
    """The step's rows in one transaction, committed only if the job is still Running at step
    t (a sliced step: still naming state t, which its plan was made from); the state's write
    (`storing`) is waited for as its last statement. `point`: the final step's validation
    (the others' are recorded after the publish: record_validation)."""
    guard = {"step": m.step} if len(info.slices) == 1 else {"step": m.step,
                                                            "state_nonce": job.state_nonce}
    now = ctx.clock()
    summary = {"train_loss": m.train_loss, "train_accuracy": m.train_accuracy, "lr": m.lr}
    finished = final_summary(ctx, job, info, m, new_state, point) if final else None
    pruned: list[str] = []
    with transaction(ctx.session_factory) as session:
        seconds = (now - job.step_started_at).total_seconds() if job.step_started_at else None
        values = {"step": new_state.step, "step_started_at": now, "state_nonce": plan.nonce,
                  "metrics": finished or {**(job.metrics or {}), **summary}}
        if finished is not None:
            succeeded = StateEvent(JobState.SUCCEEDED.value, f"trained {job.total_steps or finished.get('steps')}"
                                   f" steps; train_loss {finished['train_loss']:.6g}",
                                   data=finished)
            won = transition(session, job.id, JobState.SUCCEEDED, succeeded, now=now,
                             expect=guard, finished_at=now, reason=None, **values)
        else:
            won = update_job(session, job.id, expect={**guard, "state": JobState.RUNNING.value},
                             **values)
        if not won:
            return False
        held = job_assignments(session, job.id)
        session.add(StepMetric(job_id=job.id, step=m.step, ts=now,
                               epoch=(m.step + 1) / info.spec.steps_per_epoch,
                               train_loss=m.train_loss, train_accuracy=m.train_accuracy,
                               lr=m.lr, samples=m.samples, step_seconds=seconds,
                               devices=len(held.devices),
                               val_loss=point.val_loss if point else None,
                               val_accuracy=point.val_accuracy if point else None))
        if info.spec.audited:
            audits.record(session, job.id, m.step, plan.agreed, plan.unaudited)
        if ckpt is not None:
            session.add(ckpt.row(job.id))
            session.flush()
            pruned = prune_checkpoints(session, job.id, ctx.settings.checkpoints_kept)
        if final:
            session.flush()
            store_ops.release(session, job.id)
        else:
            boundary(ctx, session, job, new_state.step, now, held)
            if info.spec.audited or held.audits:  # over the holders the boundary left
                audits.assign_audits(ctx, session, job, info.spec, new_state.step)
        if storing is not None:
            storing.result()  # a failed write rolls the commit back
            if ctx.tuning.apply_pause_s:
                time.sleep(ctx.tuning.apply_pause_s)  # tests: widen the crash window on purpose
    if pruned:
        remove_files(pruned)  # after the commit: no row is left pointing at a removed file
    return True


def publish(ctx: SchedulerContext, job: Job, info: JobInfo, plan: SlicePlan,
            applied: Applied | None, final: bool) -> None:
    """After the commit: the next step of this process reads a whole state from memory while it
    is stored (RECENT), and this process's API serves the weights message as made (other
    processes encode it from the state: one message per step and process instead of 12.9 MB
    more through Redis on the step's critical path). The phones wake first (a sliced step's
    slice waiters too): nothing of step t+1 depends on dropping the step's keys (two round
    trips: read from the job's step index, then deleted with their entries, not a SCAN). The
    final step drops every key of the job (one SCAN of its prefix, once per job: keys the index
    never named go too)."""
    sliced = len(info.slices) > 1
    if applied is not None and not sliced:
        RECENT.remember(job.id, applied.state, plan.nonce, applied.weights)
    bump_version(ctx.blobs)
    if sliced:
        bump_version(ctx.blobs, keys.SLICES_VERSION)
    if final:  # it succeeded: its weights are in its checkpoint
        drop_job_keys(ctx, job.id)
    else:
        drop_step_keys(ctx, job.id, keep_state=job.step + 1)


# -- checkpoints and the final metrics --------------------------------------------------------

def checkpoint_every(ctx: SchedulerContext, job: Job) -> int:
    every = job.spec.get("checkpoint_every") or ctx.settings.checkpoint_every_steps
    return max(1, int(every))


def checkpoint_failed(ctx: SchedulerContext, job: Job, step: int, exc: OSError,
                      final: bool) -> None:
    """The operator's trace of a checkpoint that could not be written (a full disk): the job
    goes on without it, or, for the final one, waits for it."""
    what = ("the final checkpoint is written again when the step is retried (free space on the "
            "artifacts volume)" if final else "training goes on; the next checkpoint is tried "
            "at its turn")
    log.warning("checkpoint of step %d of %s not written: %s", step, job.id, exc)
    told = f"checkpoint of step {step} not written"
    with transaction(ctx.session_factory) as session:
        if session.scalar(select(Event.id).where(  # once per step, not once per retry
                Event.job_id == job.id, Event.reason == "CheckpointFailed",
                Event.message.startswith(told)).limit(1)) is not None:
            return
        events.record(session, "CheckpointFailed", f"{told} ({exc.strerror or exc}): {what}",
                      now=ctx.clock(), job_id=job.id, kind="Warning",
                      data={"step": step, "final": final})


def final_summary(ctx: SchedulerContext, job: Job, info: JobInfo, last: StepMetrics,
                  state: TrainState, point: ValidationPoint | None = None) -> dict:
    """Final metrics defined as the reference trainer defines them: the last epoch's mean
    train loss and accuracy, and validation on the final weights (`point` when the curve's
    last point was just measured on them: not run twice)."""
    spe = info.spec.steps_per_epoch
    with ctx.session_factory() as session:
        rows = session.query(StepMetric).filter(
            StepMetric.job_id == job.id, StepMetric.step >= last.step - spe + 1,
            StepMetric.step < last.step,
        ).all()
    losses = [r.train_loss for r in rows if r.train_loss is not None] + [last.train_loss]
    accs = [r.train_accuracy for r in rows if r.train_accuracy is not None] + [last.train_accuracy]
    data = load_dataset(info.spec.dataset, ctx.settings.data_dir)
    validated = (point.val_loss, point.val_accuracy) if point else None
    return {**final_metrics(info, state, losses, accs, data.x_val, data.y_val, validated),
            "last_step_loss": last.train_loss}
