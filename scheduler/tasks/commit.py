"""What every apply of a step shares: its outcomes, its checkpoint, and the guarded commit
(scheduler.tasks.steps applies a whole step, scheduler.tasks.slices a sliced one)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import select

from domain.store.db import transaction
from domain.store.models import Event, Job, StepMetric
from domain.store.states import Event as StateEvent
from domain.store.states import transition
from engine.data import load_dataset
from engine.jobinfo import JobInfo
from engine.runner import final_metrics
from engine.step import StepMetrics, TrainState
from scheduler import store_ops
from scheduler.checkpoints import WrittenCheckpoint, prune_checkpoints, remove_files
from scheduler.context import SchedulerContext
from scheduler.tasks import boundary
from wire.states import JobState

log = logging.getLogger(__name__)


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


def checkpoint_every(ctx: SchedulerContext, job: Job) -> int:
    every = job.spec.get("checkpoint_every") or ctx.settings.checkpoint_every_steps
    return max(1, int(every))


def commit_step(ctx: SchedulerContext, job: Job, info: JobInfo, m: StepMetrics,
                new_state: TrainState, ckpt: WrittenCheckpoint | None, final: bool,
                nonce: str, before_commit: Callable[[], None] = lambda: None,
                from_nonce: str | None = None) -> bool:
    """The step's rows, committed only if the job is still at m.step (and, given
    `from_nonce`, still names that state); `before_commit` runs inside the transaction last
    (a failure there rolls it back)."""
    guard = {"step": m.step} if from_nonce is None else {"step": m.step, "state_nonce": from_nonce}
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
                             expect=guard, finished_at=now, reason=None, **values)
        else:
            won = store_ops.guarded_job_update(session, job.id,
                                               {**guard, "state": JobState.RUNNING.value}, **values)
        if not won:
            return False
        held = store_ops.job_assignments(session, job.id)
        devices_used = len(held.devices)
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
            boundary.at_step_boundary(ctx, session, job, info, new_state.step, now, held)
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
