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
from dataclasses import replace

from domain.store.db import transaction
from domain.store.models import Job
from domain.task_metrics import observe_task
from engine.jobinfo import JobInfo, job_info_or_reason
from engine.optim import STATE_SLOTS
from engine.step import ShardResult
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
    write_checkpoint,
)
from scheduler.context import SchedulerContext, get_context
from scheduler.tasks.commit import Outcome, checkpoint_every, checkpoint_failed, commit_step
from scheduler.tasks.recovery import drop_step_keys, ensure_state
from scheduler.tasks.slices import run_sliced_step
from wire.messages import WeightsMessage
from wire.states import JobState

log = logging.getLogger(__name__)


# writes a step's new state while its weights message is sealed and its rows are written; kept
# for the process (a thread started per step cost the step ~1 ms on its critical path). Its
# threads start only when needed: the limit is above any worker's concurrency, so no apply's
# write waits behind another's (the commit waits for it holding the job's row)
STATE_WRITERS = ThreadPoolExecutor(max_workers=32, thread_name_prefix="state-write")


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
    return len(uploaded_shards(ctx.blobs, job_id, step, shards)) >= shards


def load_results(ctx: SchedulerContext, job_id: str, step: int, info: JobInfo) -> list[ShardResult] | None:
    """Stored results of `step` covering every shard once (shards' and partials', the largest
    preferred: engine.tree.choose), as views of the stored uploads, or None when a shard is
    missing; results that are corrupted or whose upload body is gone (a replica that held it
    died) are deleted, so their devices see those shards as to do again."""
    nodes = stored_nodes(ctx.blobs, job_id, step, info.spec.shards)
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
    if len(info.slices) > 1:
        return run_sliced_step(ctx, job, info)
    state = ensure_state(ctx, job, info)
    if state is None or state.step != step:
        return Outcome.STALE  # rewound after lost hot state: the job goes on from there
    results = load_results(ctx, job_id, step, info)
    if results is None:
        return Outcome.INCOMPLETE
    # the update is written straight into the blob it is stored as (weights, optimizer state,
    # buffers); the weights message every agent downloads next (the API serves it as stored)
    # takes each block of the new weights, and its checksum, on the thread that just wrote
    # it (in its cache, side by side: not one more pass over the vector after the update)
    n_params, n_buffers = info.model.n_params, info.model.n_buffers
    message = WeightsMessage(job_id, step + 1, n_params, n_buffers)
    blob = StateBlob(step + 1, n_params, n_buffers, len(STATE_SLOTS[info.spec.optimizer]))
    new_state, metrics = engine_apply_step(info.model, info.spec, state, results,
                                           workers=ctx.tuning.apply_threads,
                                           out=(blob.params, blob.opt_state, blob.buffers),
                                           done=lambda block: message.take_params(blob.params,
                                                                                  block))
    nonce = keys.new_nonce()
    state_key = keys.state(job_id, step + 1, nonce)
    # stored while the checkpoint and the step's rows are written: the commit waits for it
    # (the row names the nonce, so the state must be stored before anyone can read the name)
    storing = STATE_WRITERS.submit(ctx.blobs.set, state_key, blob.data)
    message.buffers[:] = blob.buffers  # both only read the blob meanwhile
    weights = message.seal()

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
    RECENT.remember(job_id, new_state, nonce, weights)
    # phones wake first: dropping the step's keys lists the job's keys (a SCAN, 3-4 ms in a
    # keyspace of 20,000), and nothing of step t + 1 depends on it
    bump_version(ctx.blobs)
    drop_step_keys(ctx, job_id, keep_state=step + 1)
    return Outcome.APPLIED


def _drop_unnamed(ctx: SchedulerContext, storing: Future, state_key: str) -> None:
    """A state no committed row names: deleted once its write has ended, whatever its end."""
    wait([storing])
    ctx.blobs.delete(state_key)


