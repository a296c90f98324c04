"""apply_step(job, t): every shard's result for step t in -> weights of step t+1, exactly once.

Order of effects, so that a crash anywhere repeats or repairs rather than corrupts:
1. read state t and every shard's result for t from the blob store (missing: return);
2. compute step t+1 with the engine's apply_step (shard results and partials added up the
   canonical tree, engine.tree: the same function as the reference trainer);
3. write state t+1 to the blob store under a nonce of this apply's own (and a checkpoint file
   when due) BEFORE the commit;
4. commit `UPDATE jobs SET step=t+1, state_nonce=<nonce> WHERE id=:id AND step=t` with the
   step's metrics; the loser of a race (or a retry after the commit) matches no row, changes
   nothing and deletes its state: readers follow the row's nonce, so a loser that computed
   from other results (a shard recomputed meanwhile) is never read, whenever it wrote;
5. after the commit, drop step t's keys and wake the long polls.
A crash between 3 and 4 leaves step t current and an unnamed state t+1 (dropped with the
step's keys later): the retry recomputes and commits its own.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace

from sqlalchemy import select

from api.metrics_tasks import observe_task
from api.store.db import transaction
from api.store.models import Event, Job, StepMetric
from api.store.states import Event as StateEvent
from api.store.states import JobState, transition
from engine.data import load_dataset
from engine.jobinfo import JobInfo, job_info_or_reason
from engine.optim import STATE_SLOTS
from engine.runner import final_metrics
from engine.step import ShardResult, StepMetrics, TrainState
from engine.step import apply_step as engine_apply_step
from engine.tree import choose
from hotstate import keys
from hotstate.bodies import fetch_bodies
from hotstate.gradstore import GradBlobError, body_key_of, stored_nodes, unpack, uploaded_shards
from hotstate.recent import RECENT
from hotstate.trainstate import StateBlob
from hotstate.version import bump_version
from scheduler import store_ops
from scheduler.celery_app import app
from scheduler.checkpoints import (
    WrittenCheckpoint,
    prune_checkpoints,
    remove_files,
    write_checkpoint,
)
from scheduler.context import SchedulerContext, get_context
from scheduler.tasks import boundary
from scheduler.tasks.recovery import drop_step_keys, ensure_state
from wire.messages import WeightsMessage

log = logging.getLogger(__name__)


@app.task(name="scheduler.apply_step", acks_late=True, reject_on_worker_lost=True)
def apply_step(job_id: str, step: int) -> str:
    """Idempotent: running it twice, or on two workers at once, applies the step once."""
    started, ok = time.perf_counter(), False
    try:
        outcome = run_apply_step(get_context(), job_id, int(step))
        ok = True
        return outcome
    finally:
        observe_task("apply_step", time.perf_counter() - started, ok)


def enqueue_apply(ctx: SchedulerContext, job_id: str, step: int, force: bool = False,
                  here: Callable[[str, int], None] | None = None) -> bool:
    """Send apply_step once per claim period (the claim key expires, so a lost task is resent
    to the workers). `here`: run a claimed step in this process instead (scheduler.local_apply)."""
    claimed = ctx.blobs.set_if_absent(keys.apply_claim(job_id, step), b"1",
                                      ttl=ctx.tuning.apply_claim_ttl_s)
    if claimed and here is not None:
        here(job_id, step)
    elif claimed or force:
        apply_step.apply_async((job_id, step), queue="steps")
    return claimed


def step_complete(ctx: SchedulerContext, job_id: str, step: int, shards: int) -> bool:
    return len(uploaded_shards(ctx.blobs, job_id, step)) >= shards


def load_results(ctx: SchedulerContext, job_id: str, step: int, info: JobInfo) -> list[ShardResult] | None:
    """Stored results of `step` covering every shard once (shards' and partials', the largest
    preferred: engine.tree.choose), as views of the stored uploads, or None when a shard is
    missing; results that are corrupted or whose upload body is gone (a replica that held it
    died) are deleted, so their devices see those shards as to do again."""
    nodes = stored_nodes(ctx.blobs, job_id, step)
    chosen = choose(nodes, info.spec.shards)
    if chosen is None:
        return None
    shard_keys = [nodes[node] for node in chosen]
    stored = ctx.blobs.get_many(shard_keys)
    if any(data is None for data in stored):
        return None
    refs = [_body_key(data) for data in stored]
    bodies = fetch_bodies(ctx.blobs, sorted({ref for ref in refs if ref}))
    results, broken = [], []
    for (lo, hi), key, data, ref in zip(chosen, shard_keys, stored, refs):
        try:  # a malformed reference (ref None) fails here too
            result = unpack(data, info.model.n_params, info.model.n_stats,
                            bodies.get(ref) if ref else None)
            results.append(replace(result, shard=lo, span=hi - lo))  # the key names the range
        except GradBlobError:
            broken.append(key)
    if broken:
        # their devices see these shards as to do again; the claim goes too, so the upload
        # that completes the step again enqueues this task at once, not after the claim's TTL
        ctx.blobs.delete(*broken, keys.apply_claim(job_id, step))
        return None
    return results


def _body_key(data: bytes | memoryview) -> str | None:
    try:
        return body_key_of(data)
    except GradBlobError:
        return None


@dataclass(frozen=True)
class Outcome:
    APPLIED = "applied"
    STALE = "stale"
    GONE = "gone"
    INCOMPLETE = "incomplete"
    FAILED = "failed"
    RETRY = "retry"  # not committed on purpose: applied again when the claim expires


def checkpoint_failed(ctx: SchedulerContext, job: Job, step: int, exc: OSError, final: bool) -> None:
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
        store_ops.record_event(session, "CheckpointFailed",
                               f"{told} ({exc.strerror or exc}): "
                               + what, now=ctx.clock(), job_id=job.id, kind="Warning",
                               data={"step": step, "final": final})


def run_apply_step(ctx: SchedulerContext, job_id: str, step: int) -> str:
    with ctx.session_factory() as session:
        job = session.get(Job, job_id)
        if job is None:
            return Outcome.GONE
        session.expunge(job)
    if job.state != JobState.RUNNING or job.step != step:
        return Outcome.STALE
    info, why = job_info_or_reason(job.id, job.spec, ctx.settings.data_dir)
    if info is None:
        with transaction(ctx.session_factory) as session:
            store_ops.fail_job(session, job, why or "cannot run this spec", ctx.clock())
        return Outcome.FAILED
    state = ensure_state(ctx, job, info)
    if state is None or state.step != step:
        return Outcome.STALE  # rewound after lost hot state: the job goes on from there
    results = load_results(ctx, job_id, step, info)
    if results is None:
        return Outcome.INCOMPLETE
    # the update is written straight into the two blobs it is stored as: the weights message
    # every agent downloads next (the API serves it as stored) and the state (weights,
    # optimizer state, buffers); only the weights are copied, from one into the other
    n_params, n_buffers = info.model.n_params, info.model.n_buffers
    message = WeightsMessage(job_id, step + 1, n_params, n_buffers)
    blob = StateBlob(step + 1, n_params, n_buffers, len(STATE_SLOTS[info.spec.optimizer]))
    new_state, metrics = engine_apply_step(info.model, info.spec, state, results,
                                           workers=ctx.tuning.apply_threads,
                                           out=(message.params, blob.opt_state, message.buffers))
    blob.params[:] = message.params
    blob.buffers[:] = message.buffers
    nonce = keys.new_nonce()
    state_key = keys.state(job_id, step + 1, nonce)
    # stored while the checkpoint and the step's rows are written: the commit waits for it
    # (the row names the nonce, so the state must be stored before anyone can read the name)
    writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="state-write")
    storing = writer.submit(ctx.blobs.set, state_key, blob.data)
    writer.shutdown(wait=False)  # the write goes on; no thread outlives it

    def stored() -> None:
        storing.result()
        if ctx.tuning.apply_pause_s:
            time.sleep(ctx.tuning.apply_pause_s)  # tests: widen the crash window on purpose

    final = new_state.step >= info.total_steps
    ckpt = None
    if final or new_state.step % checkpoint_every(ctx, job) == 0:
        try:
            ckpt = write_checkpoint(ctx.settings.artifacts_dir, job_id, info.model, new_state)
        except OSError as exc:
            checkpoint_failed(ctx, job, new_state.step, exc, final)
            if final:  # the job's result: not done without it; applied again when the claim
                _drop_unnamed(ctx, storing, state_key)  # expires, e.g. once space is freed
                return Outcome.RETRY
    try:
        committed = commit_step(ctx, job, info, metrics, new_state, ckpt, final, nonce,
                                before_commit=stored)
    finally:
        wait([storing])  # whatever the commit did, the write is over before this returns
    if not committed:
        _drop_unnamed(ctx, storing, state_key)  # never named: nobody reads it
        return Outcome.STALE
    # committed: the next step reads the state from here, if still stored, and this process's
    # API serves the message as made; other processes encode it from the state (one message
    # per step and process instead of 12.9 MB more through Redis on the step's critical path)
    RECENT.remember(job_id, new_state, nonce, message.seal())
    drop_step_keys(ctx, job_id, keep_state=step + 1)
    bump_version(ctx.blobs)
    return Outcome.APPLIED


def _drop_unnamed(ctx: SchedulerContext, storing: Future, state_key: str) -> None:
    """A state no committed row names: deleted once its write has ended, whatever its end."""
    wait([storing])
    ctx.blobs.delete(state_key)


def checkpoint_every(ctx: SchedulerContext, job: Job) -> int:
    every = job.spec.get("checkpoint_every") or ctx.settings.checkpoint_every_steps
    return max(1, int(every))


def commit_step(ctx: SchedulerContext, job: Job, info: JobInfo, m: StepMetrics,
                new_state: TrainState, ckpt: WrittenCheckpoint | None, final: bool,
                nonce: str, before_commit: Callable[[], None] = lambda: None) -> bool:
    """The step's rows, committed only if the job is still at m.step; `before_commit` runs
    inside the transaction last (a failure there rolls it back)."""
    now = ctx.clock()
    devices_used = 0
    pruned: list[str] = []
    summary = {"train_loss": m.train_loss, "train_accuracy": m.train_accuracy, "lr": m.lr}
    finished = final_summary(ctx, job, info, m, new_state) if final else None
    with transaction(ctx.session_factory) as session:
        seconds = (now - job.step_started_at).total_seconds() if job.step_started_at else None
        values: dict = {"step": new_state.step, "step_started_at": now, "state_nonce": nonce,
                        "metrics": finished or {**(job.metrics or {}), **summary}}
        if final:
            done = finished or {}
            succeeded = StateEvent("Succeeded", f"trained {job.total_steps or done.get('steps')} "
                                   f"steps; train_loss {done['train_loss']:.6g}", data=done)
            won = transition(session, job.id, JobState.SUCCEEDED, succeeded, now=now,
                             expect={"step": m.step}, finished_at=now, reason=None, **values)
        else:
            won = store_ops.guarded_job_update(session, job.id,
                                               {"step": m.step, "state": JobState.RUNNING.value}, **values)
        if not won:
            return False
        devices_used = len(store_ops.job_devices(session, job.id))
        session.add(StepMetric(job_id=job.id, step=m.step, ts=now,
                               epoch=(m.step + 1) / info.spec.steps_per_epoch,
                               train_loss=m.train_loss, train_accuracy=m.train_accuracy,
                               lr=m.lr, samples=m.samples, step_seconds=seconds,
                               devices=devices_used))
        if ckpt is not None:
            session.add(ckpt.row(job.id))
            session.flush()
            pruned = prune_checkpoints(session, job.id, ctx.settings.checkpoints_kept)
        if final:
            session.flush()
            store_ops.release(session, job.id)
        else:
            boundary.at_step_boundary(ctx, session, job, info, new_state.step, now)
        before_commit()
    remove_files(pruned)  # after the commit: no row is left pointing at a removed file
    return True


def final_summary(ctx: SchedulerContext, job: Job, info: JobInfo, last: StepMetrics,
                  state: TrainState) -> dict:
    """Final metrics defined as the reference trainer defines them: the last epoch's mean
    train loss and accuracy, and validation on the final weights."""
    spe = info.spec.steps_per_epoch
    with ctx.session_factory() as session:
        rows = session.query(StepMetric).filter(
            StepMetric.job_id == job.id, StepMetric.step >= last.step - spe + 1,
            StepMetric.step < last.step,
        ).all()
    losses = [r.train_loss for r in rows if r.train_loss is not None] + [last.train_loss]
    accs = [r.train_accuracy for r in rows if r.train_accuracy is not None] + [last.train_accuracy]
    data = load_dataset(info.spec.dataset, ctx.settings.data_dir)
    return {**final_metrics(info, state, losses, accs, data.x_val, data.y_val),
            "last_step_loss": last.train_loss}
