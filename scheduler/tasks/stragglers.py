"""Backups for late devices: a second copy of a straggler's shards; the first upload wins.

"Late" = the step has run longer than `straggler_timeout` of the job's typical device step
time (the median of each device's time from step start to its last upload, measured by the
gradient route), never less than the floor. Backups are dropped at the step boundary.
"""

from __future__ import annotations

import json

from domain.store import events
from domain.store.db import transaction
from domain.store.models import Job
from engine.jobinfo import JobInfo
from hotstate import keys
from hotstate.gradstore import uploaded_shards
from hotstate.version import bump_version
from scheduler import store_ops
from scheduler.context import SchedulerContext
from scheduler.policy.placement import keepable
from scheduler.policy.scores import device_speed
from scheduler.policy.straggler import expected_step_s, plan_backups, straggler_timeout
from scheduler.policy.types import PlacementRequest
from scheduler.tasks.boundary import parse_late_steps


def remember_late(ctx: SchedulerContext, job_id: str, device_id: str, step: int) -> None:
    steps = late_steps_of(ctx, job_id, device_id)
    steps = sorted(set(steps) | {step})[-4:]
    ctx.blobs.set(keys.late_steps(job_id, device_id), json.dumps(steps).encode(), ttl=3600)


def late_steps_of(ctx: SchedulerContext, job_id: str, device_id: str) -> list[int]:
    return late_steps(ctx, job_id, [device_id])[device_id]


def late_steps(ctx: SchedulerContext, job_id: str, devices: list[str]) -> dict[str, list[int]]:
    """The steps each device was late for (one round trip for all: every step boundary asks)."""
    raws = ctx.blobs.get_many([keys.late_steps(job_id, d) for d in devices])
    return {d: parse_late_steps(raw) for d, raw in zip(devices, raws)}


def measured_latencies(ctx: SchedulerContext, job_id: str, devices: list[str]) -> dict[str, float]:
    raws = ctx.blobs.get_many([keys.latency(job_id, d) for d in devices])
    out = {}
    for device, raw in zip(devices, raws):
        if raw:
            try:
                out[device] = float(raw)
            except ValueError:
                continue
    return out


def back_up_late_devices(ctx: SchedulerContext, job: Job, info: JobInfo) -> int:
    """Assign backups for the late shards of job.step; returns how many were assigned."""
    if job.step_started_at is None:
        return 0
    now = ctx.clock()
    elapsed = (now - job.step_started_at).total_seconds()
    with transaction(ctx.session_factory) as session:
        primary = store_ops.primaries(session, job.id)
        holders = sorted(set(primary.values()))
        lat = measured_latencies(ctx, job.id, holders)
        timeout = straggler_timeout(expected_step_s(lat), ctx.tuning.straggler_floor_s,
                                    ctx.tuning.straggler_factor)
        if elapsed < timeout:
            return 0
        done = uploaded_shards(ctx.blobs, job.id, job.step, info.spec.shards)
        missing = {d: s for d, s in store_ops.shards_by_device(
            {k: v for k, v in primary.items() if k not in done}).items()}
        if not missing:
            return 0
        req = PlacementRequest.for_job(job)
        views = {v.id: v for v in store_ops.held_device_views(session,
                                                              dict.fromkeys(holders, job.id))}
        able = [d for d in holders if d in views and keepable(req, views[d])]
        fastest_first = sorted(able, key=lambda d: (-device_speed(views[d], req.arch), d))
        helpers = [d for d in fastest_first if d not in missing] + [d for d in fastest_first if d in missing]
        plan = plan_backups(missing, helpers, frozenset(store_ops.backups(session, job.id)),
                            store_ops.auditors(session, job.id, job.step))
        if not plan:
            return 0
        store_ops.add_backups(session, job.id, plan, job.step)
        for device in missing:
            remember_late(ctx, job.id, device, job.step)
        events.record(
            session, "BackupAssigned",
            f"step {job.step} late after {elapsed:.1f}s (timeout {timeout:.1f}s): "
            f"shards {sorted(plan)} of {', '.join(sorted(missing))} also given to "
            f"{', '.join(sorted(set(plan.values())))}",
            now=now, job_id=job.id, kind="Warning",
            data={"step": job.step, "late": sorted(missing), "backups": {str(k): v for k, v in plan.items()}},
        )
    bump_version(ctx.blobs)
    return len(plan)
