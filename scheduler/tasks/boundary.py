"""What happens to a job's shards at a step boundary: the apply pipeline's extension point
(scheduler.apply.StepBoundary), which the step's tasks hand it; called inside the step's
commit, so a move commits with the step or not at all, and never at the final step.

Backups of the finished step are dropped, and a device that needed backups two steps running
gets half its share of shards (it keeps at least one). When reconcile flagged the job (eligible
devices are free and the job is below max_devices), the new devices join here, so a device
never loses shards in the middle of computing them just because another one arrived.
"""

from __future__ import annotations

import datetime as dt
import json

from sqlalchemy.orm import Session

from domain.store import events
from domain.store.jobs import JobAssignments
from domain.store.models import Job
from hotstate import keys, locks
from scheduler import store_ops
from scheduler.context import SchedulerContext
from scheduler.policy import quota
from scheduler.policy.placement import rebalance
from scheduler.policy.scores import device_speed
from scheduler.policy.shards import balance_shards, moved_shards
from scheduler.policy.straggler import demoted_speeds, persistent_stragglers
from scheduler.policy.types import PlacementRequest


def at_step_boundary(ctx: SchedulerContext, session: Session, job: Job, new_step: int,
                     now: dt.datetime, held: JobAssignments) -> None:
    """`held`: the job's assignments as the commit read them. Each round trip here is on the
    step's critical path, so the boundary asks Redis once (the rebalance flag and the holders'
    late steps together) and deletes backups only when there are some."""
    if held.backups:
        store_ops.drop_backups(session, job.id)
    holders = sorted(set(held.primaries.values()))
    flag, *late = ctx.blobs.get_many([keys.rebalance(job.id),
                                      *(keys.late_steps(job.id, d) for d in holders)])
    demote_stragglers(ctx, session, job, new_step, now, held.primaries,
                      {d: parse_late_steps(raw) for d, raw in zip(holders, late)})
    if flag is None:
        return
    with locks.held(ctx.blobs, keys.PLACEMENT_LOCK, ctx.tuning.lock_ttl_s) as token:
        if token is None:
            return  # a placement pass runs: the flag stays, the next boundary tries again
        join_devices(ctx, session, job, new_step, now)
        ctx.blobs.delete(keys.rebalance(job.id))


def parse_late_steps(raw: bytes | None) -> list[int]:
    """A device's late steps as stored under keys.late_steps (scheduler.tasks.stragglers
    writes them; none when unreadable)."""
    try:
        return [int(s) for s in json.loads(raw)] if raw else []
    except (ValueError, TypeError):
        return []


def join_devices(ctx: SchedulerContext, session: Session, job: Job, step: int,
                 now: dt.datetime) -> list[str]:
    """Add free eligible devices to a running job, up to max_devices; returns those added."""
    views = store_ops.all_device_views(session)
    usage = store_ops.user_usage(session, job.owner, views, job.id)
    req = quota.within_limits(PlacementRequest.for_job(job),
                              job.owner, usage, ctx.user_limits)
    holders = [d for d in views if d.job_id == job.id]
    joiners = [d for d in views if d.job_id is None]
    current = store_ops.primaries(session, job.id)
    plan = rebalance(req, holders, joiners, current)
    if not plan.admitted:
        return []
    added = sorted(set(plan.devices) - {d.id for d in holders})
    if not added:
        return []
    moved = store_ops.set_primaries(session, job.id, plan.shards, since_step=step)
    for device in added:
        events.record(session, "DeviceJoined", f"{device} joined at step {step}", now=now,
                      job_id=job.id, device_id=device)
    events.record(session, "ShardsMoved",
                  f"{len(moved_shards(current, plan.shards))} shard(s) rebalanced over "
                  f"{len(plan.devices)} device(s) at step {step}", now=now,
                  job_id=job.id, data={"shards": moved, "devices": list(plan.devices),
                                       "step": step,
                                       "counts": store_ops.shard_counts(plan.shards)})
    return added


def demote_stragglers(ctx: SchedulerContext, session: Session, job: Job, new_step: int,
                      now: dt.datetime, current: dict[int, str],
                      late: dict[str, list[int]]) -> list[str]:
    """Halve the share of a device that needed backups two steps running (kept >= 1 shard).
    `current`: the primaries; `late`: the steps each of their devices was late for."""
    holders = sorted(set(current.values()))
    slow = persistent_stragglers(late, new_step - 1)
    if not slow or len(holders) < 2:
        return []
    req = PlacementRequest.for_job(job)
    views = {v.id: v for v in store_ops.held_device_views(session, dict.fromkeys(holders, job.id))}
    factors = {d: _factor(ctx, job.id, d) for d in holders}
    for device in slow:
        factors[device] *= 0.5
        ctx.blobs.set(keys.slow_factor(job.id, device), str(factors[device]).encode(), ttl=3600)
        ctx.blobs.delete(keys.late_steps(job.id, device))  # two more late steps to halve again
    speeds = demoted_speeds({d: device_speed(views[d], req.arch) for d in holders if d in views},
                            factors)
    plan = balance_shards(req.shards, speeds, current)
    moved = store_ops.set_primaries(session, job.id, plan, since_step=new_step)
    if moved:
        events.record(
            session, "ShardsMoved",
            f"{len(moved)} shard(s) moved at step {new_step} away from persistent "
            f"straggler(s) {', '.join(slow)}", now=now, job_id=job.id,
            data={"shards": moved, "from": slow, "reason": "straggler", "step": new_step,
                  "counts": store_ops.shard_counts(plan)})
    return slow


def _factor(ctx: SchedulerContext, job_id: str, device_id: str) -> float:
    raw = ctx.blobs.get(keys.slow_factor(job_id, device_id))
    try:
        return min(1.0, max(1e-3, float(raw))) if raw else 1.0
    except ValueError:
        return 1.0
