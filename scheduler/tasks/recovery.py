"""Hot state that went missing (Redis restarted empty, keys evicted) is rebuilt, never guessed.

The job's weights for its current step are either in the blob store, or the job rewinds to its
latest readable checkpoint (or to step 0's seeded init when it has none) and recomputes from
there; the math is a function of (spec, seed), so the rewound run ends where it would have.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import delete, select

from domain.store.audits import forget_unaudited
from domain.store.db import transaction
from domain.store.models import Job, StepMetric
from domain.store.states import Event, update_job
from engine.jobinfo import JobInfo
from engine.slices import Bounds
from engine.step import TrainState, cut_state, initial_state, join_states
from hotstate import keys
from hotstate.recent import RECENT, RECENT_SLICES
from hotstate.trainstate import StateError, decode_state, encode_state
from hotstate.version import bump_version
from scheduler import store_ops
from scheduler.checkpoints import (
    drop_checkpoints_after,
    latest_checkpoint,
    read_checkpoint,
    remove_files,
)
from scheduler.context import SchedulerContext
from wire.states import ACTIVE_STATES


def load_state(ctx: SchedulerContext, job_id: str, step: int, nonce: str | None,
               bounds: Sequence[Bounds] = ((0, 0),)) -> TrainState | None:
    """The state of `step` stored under `nonce` (the job row's `state_nonce`); a sliced job's
    (`bounds`: its slices) joined from its slices."""
    if len(bounds) > 1:
        parts = [load_slice(ctx, job_id, step, nonce, i) for i in range(len(bounds))]
        if any(p is None for p in parts):
            return None
        return join_states([p for p in parts if p is not None], bounds)
    key = keys.state(job_id, step, nonce)
    recent = RECENT.get(job_id, step, nonce)
    if recent is not None and ctx.blobs.exists(key):
        return recent
    return _decode(ctx.blobs.get(key), step)


def load_slice(ctx: SchedulerContext, job_id: str, step: int, nonce: str | None,
               index: int) -> TrainState | None:
    """Slice `index`'s part of the state of `step` (engine.step.cut_state's)."""
    key = keys.state_slice(job_id, step, nonce, index)
    recent = RECENT_SLICES.get(slice_name(job_id, index), step, nonce)
    if recent is not None and ctx.blobs.exists(key):
        return recent
    return _decode(ctx.blobs.get(key), step)


def slice_name(job_id: str, index: int) -> str:
    """What this process's RECENT cache keeps a slice's state under."""
    return f"{job_id}#s{index}"


def _decode(data: bytes | None, step: int) -> TrainState | None:
    if data is None:
        return None
    try:
        return decode_state(data, expect_step=step)
    except StateError:
        return None


def store_state(ctx: SchedulerContext, job_id: str, nonce: str, state: TrainState,
                bounds: Sequence[Bounds]) -> list[str]:
    """Write `state` under `nonce` (cut into its slices when sliced); the keys written."""
    parts = [state] if len(bounds) == 1 else [cut_state(state, b) for b in bounds]
    names = keys.state_keys(job_id, state.step, nonce, len(bounds))
    for key, part in zip(names, parts):
        ctx.blobs.set(key, encode_state(part))
    return names


def restore_point(ctx: SchedulerContext, job: Job, info: JobInfo,
                  at_most: int | None = None) -> TrainState:
    """The newest state at or before job.step (or `at_most`) that survives outside the blob
    store: a readable checkpoint, else step 0's seeded initial state."""
    at_most = job.step if at_most is None else at_most
    with ctx.session_factory() as session:
        while at_most >= 0:
            row = latest_checkpoint(session, job.id, at_most)
            if row is None:
                break
            state = read_checkpoint(row, info.model)
            if state is not None and state.step == row.step:
                return state
            at_most = row.step - 1  # unreadable file: try an older one
    return initial_state(info.model, info.spec)


def ensure_state(ctx: SchedulerContext, job: Job, info: JobInfo) -> TrainState | None:
    """The state of job.step, restoring (and rewinding the job) when the blob store lost it.

    Returns None when another task moved the job meanwhile (the caller just stops).
    """
    state = load_state(ctx, job.id, job.step, job.state_nonce, info.slices)
    if state is not None:
        return state
    if not _still_names(ctx, job):
        return None  # a step committed since `job` was read and its state replaced this one
    restored = restore_point(ctx, job, info)
    # state first, then the row naming it: a crash in between leaves a harmless extra key
    nonce = keys.new_nonce()
    written = store_state(ctx, job.id, nonce, restored, info.slices)
    now = ctx.clock()
    lost = _restore_event(job, restored)
    if restored.step == job.step:
        with transaction(ctx.session_factory) as session:
            # lost, but a checkpoint of this step brings it back (step 0: the seeded init,
            # nothing to tell)
            won = update_job(session, job.id,
                             expect={"step": job.step, "state_nonce": job.state_nonce},
                             event=lost if job.step > 0 else None, now=now, state_nonce=nonce)
        if not won:  # another restore or apply named its own state meanwhile
            ctx.blobs.delete(*written)
            return None
        bump_version(ctx.blobs)  # long polls hold back work until the weights exist
        return restored
    return _rewound(ctx, job, restored, nonce, written, lost)


def rewind(ctx: SchedulerContext, job: Job, info: JobInfo, to_step: int,
           event: Event) -> TrainState | None:
    """Take the job back to the newest readable checkpoint at or before `to_step` (step 0's
    seeded init without one), through the restore path: an audit found a device lying, and
    the state after that step may hold its unchecked results (scheduler.audits). Checkpoints
    after it go (rows and files: they hold what is undone), and so do the audit records'
    unaudited results past it. None when the job moved meanwhile."""
    restored = restore_point(ctx, job, info, to_step)
    nonce = keys.new_nonce()
    written = store_state(ctx, job.id, nonce, restored, info.slices)
    return _rewound(ctx, job, restored, nonce, written, event, drop_later=True)


def _rewound(ctx: SchedulerContext, job: Job, restored: TrainState, nonce: str,
             written: list[str], event: Event, drop_later: bool = False) -> TrainState | None:
    """The job's row moved back to `restored` (stored under `nonce` as `written`), guarded by
    the step and state it was at; what came after it forgotten."""
    now, removed = ctx.clock(), []
    with transaction(ctx.session_factory) as session:
        won = update_job(session, job.id, expect={"step": job.step, "state": ACTIVE_STATES,
                                                  "state_nonce": job.state_nonce},
                         event=event, now=now, metrics=_before(job.metrics),
                         step=restored.step, step_started_at=now, state_nonce=nonce)
        if not won:
            ctx.blobs.delete(*written)
            return None
        session.execute(delete(StepMetric).where(StepMetric.job_id == job.id,
                                                 StepMetric.step >= restored.step))
        store_ops.drop_backups(session, job.id)
        if drop_later:
            removed = drop_checkpoints_after(session, job.id, restored.step)
            forget_unaudited(session, job.id, restored.step)
    remove_files(removed)  # after the commit: no row is left pointing at a removed file
    bump_version(ctx.blobs)  # first: a replica's cached job row is stale until it sees this
    drop_step_keys(ctx, job.id, keep_state=restored.step, rewound=True)
    return restored


def _before(metrics: dict | None) -> dict:
    """A rewound job's metrics without the validation point of weights it no longer has (the
    step rows from the restored step on are deleted with it; the next point comes again)."""
    return {k: v for k, v in (metrics or {}).items() if k not in ("val_loss", "val_accuracy")}


def _still_names(ctx: SchedulerContext, job: Job) -> bool:
    """Whether the job's row still names the state `job` names. A reconcile that read the row
    just before a commit finds that state dropped: nothing was lost, and a restore (a model
    built, a checkpoint read, a state written, all thrown away by the guarded update) would
    only take CPU from the step running meanwhile."""
    with ctx.session_factory() as session:
        row = session.execute(select(Job.step, Job.state_nonce).where(Job.id == job.id)).first()
    return row is not None and tuple(row) == (job.step, job.state_nonce)


def drop_job_keys(ctx: SchedulerContext, job_id: str) -> None:
    """Delete every hot key of a job that has ended: the keys under its prefix (one SCAN,
    once per job) and what its step index still names (keys Redis expired; the index goes
    once emptied). The SCAN also finds keys the index never named (written before it
    existed, or an index Redis evicted)."""
    stale = {*ctx.blobs.keys(keys.job_prefix(job_id)), *ctx.blobs.step_keys(job_id)}
    if stale:
        ctx.blobs.delete(*stale)


def drop_step_keys(ctx: SchedulerContext, job_id: str, keep_state: int, rewound: bool = False) -> None:
    """Delete a job's per-step keys older than `keep_state` (after a rewind: every other step's).

    Routine cleanup must never touch later steps: the job may have advanced meanwhile. The keys
    come from the job's step index, not a SCAN: every applied step and reconcile pass drops, and
    a SCAN walks the whole keyspace (6.4 ms at 20,000 keys, growing with the fleet). A key the
    index lacks (written before it existed) is left to the job's final cleanup (drop_job_keys).
    """
    stale = ctx.blobs.step_keys(job_id, 0, keep_state)
    if rewound:
        stale += ctx.blobs.step_keys(job_id, keep_state + 1)
    if stale:
        ctx.blobs.delete(*stale)


def _restore_event(job: Job, restored: TrainState) -> Event:
    """The operator's trace of a lost hot state, whether or not the job had to rewind."""
    return Event(
        "StateRestored",
        f"hot state of step {job.step} was lost; resumed from "
        + (f"checkpoint step {restored.step}" if restored.step else "step 0 (seeded init)"),
        "Warning", {"lost_step": job.step, "resumed_step": restored.step},
    )
