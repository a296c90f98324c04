"""apply_step(job, t): every shard's result for step t in -> weights of step t+1, exactly once.

The task reads the job's row and hands the step to the apply pipeline (scheduler.apply; a
sliced job's to scheduler.tasks.slices, which runs the same pipeline once per slice), with the
step boundary's placement (scheduler.tasks.boundary) as its extension point. Order of effects,
so that a crash anywhere repeats or repairs rather than corrupts:
1. read state t and every shard's result for t from the blob store (missing: return);
2. compute step t+1 with the engine's apply_step (shard results and partials added up the
   canonical tree, engine.tree: the same function as the reference trainer);
3. write state t+1 to the blob store under a nonce of this apply's own (and a checkpoint file
   when due) BEFORE the commit;
4. commit `UPDATE jobs SET step=t+1, state_nonce=<nonce> WHERE id=:id AND step=t` with the
   step's metrics; the loser of a race (or a retry after the commit) matches no row, changes
   nothing and deletes its state: readers follow the row's nonce, so a loser that computed
   from other results (a shard recomputed meanwhile) is never read, whenever it wrote;
5. after the commit, wake the long polls and drop step t's keys.
A crash between 3 and 4 leaves step t current and an unnamed state t+1 (dropped with the
step's keys later): the retry recomputes and commits its own. Results found broken are deleted
with the step's claim; a final step whose checkpoint cannot be written is not committed (RETRY).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from domain.store.db import transaction
from domain.store.models import Job
from domain.task_metrics import observe_task
from engine.jobinfo import job_info_or_reason
from hotstate import keys
from hotstate.gradstore import uploaded_shards
from scheduler import store_ops
from scheduler.apply import Outcome, StepBoundary, run_range
from scheduler.celery_app import app
from scheduler.context import SchedulerContext, get_context
from scheduler.tasks.boundary import at_step_boundary
from scheduler.tasks.slices import run_sliced_step
from wire.states import JobState


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


def run_apply_step(ctx: SchedulerContext, job_id: str, step: int,
                   boundary: StepBoundary = at_step_boundary) -> str:
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
        return run_sliced_step(ctx, job, info, boundary)
    return run_range(ctx, job, info, 0, boundary)
