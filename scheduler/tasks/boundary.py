"""What happens to a job's shards at a step boundary (inside apply_step's commit).

Backups of the finished step are dropped. When reconcile flagged the job (eligible devices are
free and the job is below max_devices), the new devices join here, so a device never loses
shards in the middle of computing them just because another one arrived.
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy.orm import Session

from api.store.models import Job
from scheduler import keys, locks, store_ops
from scheduler.context import SchedulerContext
from scheduler.jobinfo import JobInfo
from scheduler.policy.placement import rebalance
from scheduler.policy.shards import moved_shards
from scheduler.policy.types import PlacementRequest


def at_step_boundary(ctx: SchedulerContext, session: Session, job: Job, info: JobInfo,
                     new_step: int, now: dt.datetime) -> None:
    store_ops.drop_backups(session, job.id)
    if ctx.blobs.get(keys.rebalance(job.id)) is None:
        return
    with locks.held(ctx.blobs, keys.PLACEMENT_LOCK, ctx.tuning.lock_ttl_s) as token:
        if token is None:
            return  # a placement pass runs: the flag stays, the next boundary tries again
        join_devices(ctx, session, job, new_step, now)
        ctx.blobs.delete(keys.rebalance(job.id))


def join_devices(ctx: SchedulerContext, session: Session, job: Job, step: int,
                 now: dt.datetime) -> list[str]:
    """Add free eligible devices to a running job, up to max_devices; returns those added."""
    req = PlacementRequest.from_spec(job.id, job.spec, job.priority)
    views = store_ops.all_device_views(session)
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
        store_ops.record_event(session, "DeviceJoined",
                               f"{device} joined at step {step}", now=now, job_id=job.id,
                               device_id=device)
    store_ops.record_event(session, "ShardsMoved",
                           f"{len(moved_shards(current, plan.shards))} shard(s) rebalanced over "
                           f"{len(plan.devices)} device(s) at step {step}", now=now,
                           job_id=job.id, data={"shards": moved, "devices": list(plan.devices)})
    return added
