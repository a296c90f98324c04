"""A sliced job's step (engine.slices): one task per slice, the slices in parallel across the
workers, the step committed once every slice of it is stored. Each slice runs the apply
pipeline (scheduler.apply) with its range; this module plans the step and fans it out.

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
   step (scheduler.apply.commit_step), guarded by state t's nonce too; the loser of a race
   changes nothing and deletes nothing (the slices are the winner's too).

A result of the plan that is gone (the replica holding its body died) deletes the plan with
the result: its shards are to do again, and the next complete upload plans the step afresh
under a new nonce. Slices stored under the old one are never named by a commit (it checks the
plan it completes is still the step's) and go with the step's keys.
"""

from __future__ import annotations

import time

from domain.store.models import Job
from domain.task_metrics import observe_task
from engine.jobinfo import JobInfo, job_info_or_reason
from hotstate import keys
from hotstate.sliceplan import SlicePlan
from hotstate.trainstate import state_stored
from scheduler.apply import Outcome, StepBoundary, commit_step, plan_step, run_range, stored_plan
from scheduler.celery_app import app
from scheduler.context import SchedulerContext, get_context
from scheduler.tasks.boundary import at_step_boundary
from scheduler.tasks.recovery import ensure_state
from wire.states import JobState


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


def run_sliced_step(ctx: SchedulerContext, job: Job, info: JobInfo,
                    boundary: StepBoundary = at_step_boundary) -> str:
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
    plan = plan_step(ctx, job, info)
    if plan is None:
        return Outcome.INCOMPLETE
    todo = _not_done(ctx, job, info, plan)
    if not todo:  # every slice stored, the commit not (its task died): commit now
        return commit_step(ctx, job, info, plan, boundary)
    if ctx.tuning.slices_inline:
        outcomes = [run_apply_slice(ctx, job.id, step, index, boundary) for index in todo]
        return outcomes[-1]
    for index in todo[1:]:
        if ctx.blobs.set_if_absent(keys.slice_claim(job.id, step, plan.nonce, index), b"1",
                                   ttl=ctx.tuning.apply_claim_ttl_s):
            send_slice(job.id, step, index)
    return run_apply_slice(ctx, job.id, step, todo[0], boundary)


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


def run_apply_slice(ctx: SchedulerContext, job_id: str, step: int, index: int,
                    boundary: StepBoundary = at_step_boundary) -> str:
    job = _job(ctx, job_id)
    if job is None:
        return Outcome.GONE
    if job.state != JobState.RUNNING or job.step != step:
        return Outcome.STALE
    info, _ = job_info_or_reason(job.id, job.spec, ctx.settings.data_dir)
    if info is None or index >= len(info.slices):
        return Outcome.STALE  # the step's own task fails the job with the reason
    plan = stored_plan(ctx, job)
    if plan is None:
        return Outcome.INCOMPLETE  # replanned after a lost result: the new plan's tasks apply it
    if ctx.blobs.exists(keys.slice_done(job.id, step, plan.nonce, index)):
        return commit_step(ctx, job, info, plan, boundary)
    return run_range(ctx, job, info, index, boundary, plan)
