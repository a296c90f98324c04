"""The reconcile loop, level-triggered like a Kubernetes controller.

`reconcile` (the monitor, every `reconcile_interval_s` from beat and on every API hook):
leases expired -> NotReady (the control plane's `mark_stale_devices`); telemetry history
older than `telemetry_retention_s` is pruned (at most once a minute, by whichever worker gets
there first); then, under the placement lock, shards move off devices that left, Pending gangs
are placed (preempting lower priorities when they must), and idle phones are told to install
an agent rollout (a few at a time); then one `reconcile_job` per job that needs looking
after.

`reconcile_job(job_id)` (per entity, idempotent): a finished or cancelled job's assignments
are released; lost hot state is restored; a step whose every shard is in but which nobody
applied is re-enqueued; late devices get their shards backed up elsewhere.
"""

from __future__ import annotations

import datetime as dt
import logging
import time

from sqlalchemy.exc import IntegrityError

from domain.store import events
from domain.store.db import transaction
from domain.store.devices import prune_telemetry
from domain.store.lifecycle import mark_stale_devices
from domain.store.models import Job
from domain.store.retention import prune_job_history
from domain.task_metrics import observe_task
from engine.jobinfo import job_info_or_reason
from hotstate import keys, locks
from hotstate.trainstate import state_stored
from hotstate.version import bump_version
from scheduler import audits, store_ops
from scheduler.celery_app import app
from scheduler.context import SchedulerContext, get_context
from scheduler.tasks import stragglers
from scheduler.tasks.placement import placement_pass
from scheduler.tasks.recovery import drop_job_keys, drop_step_keys, ensure_state
from scheduler.tasks.steps import enqueue_apply, step_complete
from scheduler.tasks.upgrades import upgrade_pass
from wire.states import JobState

log = logging.getLogger(__name__)
HOOK_DEDUP_S = 0.2  # a burst of API changes sends one reconcile
APPLY_DUE_TTL_S = 3600.0  # a complete step's first sighting (dropped with the step's keys)
HISTORY_PRUNE_EVERY_S = 600.0
PRUNE_EVERY_S = 60.0  # telemetry pruning is a range delete on an indexed ts: cheap, but not per pass


@app.task(name="scheduler.reconcile", acks_late=True)
def reconcile() -> dict:
    started, ok = time.perf_counter(), False
    try:
        summary = run_reconcile(get_context())
        ok = True
        return summary
    finally:
        observe_task("reconcile", time.perf_counter() - started, ok)


@app.task(name="scheduler.reconcile_job", acks_late=True)
def reconcile_job(job_id: str) -> str:
    return run_reconcile_job(get_context(), job_id)


def request_reconcile(ctx: SchedulerContext) -> None:
    """Ask for a pass soon (API hooks); many asks within HOOK_DEDUP_S send one task."""
    if ctx.blobs.set_if_absent(keys.RECONCILE_ASKED, b"1", ttl=HOOK_DEDUP_S):
        reconcile.apply_async(queue="control")


def run_reconcile(ctx: SchedulerContext) -> dict:
    now = ctx.clock()
    stale = mark_stale(ctx, now)
    pruned = prune_history(ctx, now)
    summary: dict = {"stale": stale, "pruned": pruned.pop("telemetry", 0), "pruned_history": pruned}
    with locks.held(ctx.blobs, keys.PLACEMENT_LOCK, ctx.tuning.lock_ttl_s) as token:
        if token is not None:
            with transaction(ctx.session_factory) as session:
                result = placement_pass(ctx, session, now)
            summary.update(placed=result.placed, waiting=result.waiting,
                           preempted=result.preempted, moved=result.moved)
            if result.changed:
                bump_version(ctx.blobs)
            with transaction(ctx.session_factory) as session:
                upgrades = upgrade_pass(session, now, ctx.settings.agent_upgrade_timeout_s)
            if upgrades.start or upgrades.done or upgrades.timed_out:
                summary.update(upgrades_started=upgrades.start, upgraded=upgrades.done,
                               upgrades_timed_out=upgrades.timed_out)
    for job_id in sorted(set(summary.get("placed") or []) | set(jobs_to_look_after(ctx))):
        enqueue_reconcile_job(ctx, job_id)
    return summary


def enqueue_reconcile_job(ctx: SchedulerContext, job_id: str) -> None:
    """One pending reconcile_job per job: a burst of monitor passes does not pile them up."""
    ttl = max(0.1, ctx.settings.reconcile_interval_s / 2)
    if ctx.blobs.set_if_absent(keys.reconcile_claim(job_id), b"1", ttl=ttl):
        reconcile_job.apply_async((job_id,), queue="control")


def mark_stale(ctx: SchedulerContext, now: dt.datetime) -> int:
    with transaction(ctx.session_factory) as session:
        changed = mark_stale_devices(session, now, ctx.settings.lease_grace_s)
    return len(changed) if isinstance(changed, (list, tuple, set)) else int(changed or 0)


def prune_history(ctx: SchedulerContext, now: dt.datetime) -> dict[str, int]:
    """Drop telemetry samples past the retention window (the latest stays on the device row),
    each job's events and step metrics past the newest K, old device events."""
    settings, pruned = ctx.settings, {}
    if ctx.blobs.set_if_absent(keys.TELEMETRY_PRUNED, b"1", ttl=PRUNE_EVERY_S):
        cutoff = now - dt.timedelta(seconds=settings.telemetry_retention_s)
        with transaction(ctx.session_factory) as session:
            pruned["telemetry"] = prune_telemetry(session, cutoff)
    # counting rows per job scans the job_id index of both tables: every 10 minutes is enough
    if ctx.blobs.set_if_absent(keys.HISTORY_PRUNED, b"1", ttl=HISTORY_PRUNE_EVERY_S):
        with transaction(ctx.session_factory) as session:
            history = prune_job_history(
                session, events_kept=settings.events_kept_per_job,
                step_metrics_kept=settings.step_metrics_kept_per_job,
                device_events_before=now - dt.timedelta(
                    seconds=settings.device_event_retention_s))
        pruned.update(events=history.events, step_metrics=history.step_metrics)
    return pruned


def jobs_to_look_after(ctx: SchedulerContext) -> list[str]:
    with ctx.session_factory() as session:
        running = [j.id for j in store_ops.jobs_in(session, [JobState.RUNNING.value])]
        leftovers = store_ops.jobs_with_assignments(session)
    return sorted(set(running) | set(leftovers))


def first_sight_of_a_counted_step(ctx: SchedulerContext, job_id: str, step: int,
                                  shards: int) -> bool:
    """Whether this pass leaves a complete step to the replica that completed it. The upload
    that completes a step (its count reaches the shards) claims the step within milliseconds
    and that replica applies it from its own memory; a pass that sees the step complete just
    before that claim would send it to a worker, which must fetch every body first. So the
    first pass that sees it complete only marks it, and a later one sends it (claiming it
    unless the replica's claim holds: that replica died, or its apply failed and the claim
    expired). Results no upload counted (a replica of an older version stored them) have no
    claim coming: sent at once."""
    if int(ctx.blobs.get(keys.covered(job_id, step)) or 0) < shards:
        return False
    return ctx.blobs.set_if_absent(keys.apply_due(job_id, step), b"1", ttl=APPLY_DUE_TTL_S)


def run_reconcile_job(ctx: SchedulerContext, job_id: str) -> str:
    with ctx.session_factory() as session:
        job = session.get(Job, job_id)
        if job is not None:
            session.expunge(job)
    if job is None:
        return "gone"
    if job.state in store_ops.TERMINAL:
        return release_finished(ctx, job)
    if job.state != JobState.RUNNING:
        return "pending"
    info, why = job_info_or_reason(job.id, job.spec, ctx.settings.data_dir)
    if info is None:
        return fail(ctx, job, why or "cannot run this spec")
    # never read 25 MB: whether the state's keys exist
    if not state_stored(ctx.blobs, job.id, job.step, job.state_nonce, len(info.slices)):
        state = ensure_state(ctx, job, info)
        if state is None:
            return "moved-on"  # committed since the row was read: the next pass looks again
        if state.step != job.step:
            return "restored"
    audits.ensure_audits(ctx, job, info)  # a step no boundary planned (the first, a resume)
    if step_complete(ctx, job.id, job.step, info.spec.shards):
        if first_sight_of_a_counted_step(ctx, job.id, job.step, info.spec.shards):
            return "apply-due"
        enqueue_apply(ctx, job.id, job.step)  # claims it, unless the replica's claim holds
        return "apply-enqueued"
    drop_step_keys(ctx, job.id, keep_state=job.step)
    try:
        backed = stragglers.back_up_late_devices(ctx, job, info)
    except IntegrityError:
        return "raced"  # another reconcile_job added the same backups
    return f"backups:{backed}" if backed else "ok"


def release_finished(ctx: SchedulerContext, job: Job) -> str:
    with transaction(ctx.session_factory) as session:
        released = store_ops.release(session, job.id)
        if released:
            events.record(session, "Released",
                          f"{job.state}: released {released} shard assignment(s)",
                          now=ctx.clock(), job_id=job.id)
    drop_job_keys(ctx, job.id)
    if released:
        bump_version(ctx.blobs)
    return f"released:{released}"


def fail(ctx: SchedulerContext, job: Job, reason: str) -> str:
    with transaction(ctx.session_factory) as session:
        store_ops.fail_job(session, job, reason, ctx.clock())
    bump_version(ctx.blobs)
    return "failed"
