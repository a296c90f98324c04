"""The placement pass (one at a time, under the placement lock): evictions, gangs, preemption.

It works on the whole fleet at once because a device holds at most one job: placing two jobs
separately could hand the same phone to both. It reads what the pass needs, not the fleet
every time (issue 45: 2 s passes over 100,000 devices): the holders of the running jobs
always; the free devices only when a pending job is placed, or a running job short of its
wanted devices looks for one more (reading in batches until one fits); the eviction limit's
counts from the database.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

from domain.store import events
from domain.store.models import Job
from domain.store.states import Event as StateEvent
from domain.store.states import transition, update_job
from engine.jobinfo import job_info_or_reason
from hotstate import keys
from scheduler import store_ops
from scheduler.context import SchedulerContext
from scheduler.policy import quota
from scheduler.policy.eviction import EvictionLimits, allowed_evictions, prune
from scheduler.policy.placement import (
    choose_compute_class,
    feasible,
    keepable,
    place_gang,
    rebalance,
)
from scheduler.policy.preemption import plan_preemption
from scheduler.policy.types import DeviceView, PlacementRequest, RunningJob
from wire.states import DeviceState, JobState

log = logging.getLogger(__name__)


@dataclass
class PassResult:
    placed: list[str] = field(default_factory=list)  # jobs that started (or resumed) running
    waiting: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    moved: dict[str, list[int]] = field(default_factory=dict)

    @property
    def changed(self) -> bool:
        return bool(self.placed or self.preempted or self.moved or self.waiting)


class Fleet:
    """The device views of this pass, updated as jobs take and free devices. Read lazily:
    every job's holders at first, the whole fleet on the first call that needs it (`all`)."""

    def __init__(self, session: Session) -> None:
        self.session = session
        self.by_id = {d.id: d for d in store_ops.held_device_views(
            session, store_ops.device_jobs(session))}
        self.whole = False

    def all(self) -> list[DeviceView]:
        if not self.whole:  # the views already here keep what this pass changed
            for view in store_ops.all_device_views(self.session):
                self.by_id.setdefault(view.id, view)
            self.whole = True
        return sorted(self.by_id.values(), key=lambda d: d.id)

    def any_free_fits(self, req: PlacementRequest) -> bool:
        """Whether a device that holds no job passes `req`'s filters; read in batches up to
        the first that has one (a healthy fleet: the first batch)."""
        here = [d for d in self.by_id.values() if d.job_id is None]  # all, or freed in this pass
        if feasible(req, here)[0]:
            return True
        return not self.whole and any(
            feasible(req, batch)[0]
            for batch in store_ops.free_device_views(self.session, self.by_id))

    def of(self, job_id: str) -> list[DeviceView]:
        return [d for d in self.by_id.values() if d.job_id == job_id]

    def assign(self, job_id: str | None, device_ids: list[str] | tuple[str, ...]) -> None:
        for device_id in device_ids:
            self.by_id[device_id] = replace(self.by_id[device_id], job_id=job_id)

    def free_job(self, job_id: str) -> None:
        self.assign(None, [d.id for d in self.of(job_id)])


def placement_pass(ctx: SchedulerContext, session: Session, now: dt.datetime) -> PassResult:
    result = PassResult()
    fleet = Fleet(session)
    budget = EvictionBudget(ctx, fleet, now)
    for job in store_ops.jobs_in(session, [JobState.RUNNING.value]):
        alone(session, job, now, partial(keep_running, ctx, session, job, fleet, budget, now,
                                         result))
    for job in store_ops.jobs_in(session, [JobState.PENDING.value]):
        alone(session, job, now, partial(place_pending, ctx, session, job, fleet, now, result))
    budget.save()
    return result


def alone(session: Session, job: Job, now: dt.datetime, work: Callable[[], None]) -> None:
    """One job's share of the pass, in a savepoint: if the job's own work raises, that job
    fails with the reason and the pass goes on for every other (invariant 5). The database or
    the network failing is not the job's fault: that still ends the pass, for the next one."""
    try:
        with session.begin_nested():
            work()
    except (SQLAlchemyError, OSError):
        raise
    except Exception as exc:  # MemoryError included: a spec whose model cannot be allocated
        log.exception("placing %s failed; the job fails, the pass goes on", job.id)
        why = f"the scheduler could not place it: {type(exc).__name__}: {exc}"[:1000]
        with session.begin_nested():
            store_ops.fail_job(session, job, why, now)


class EvictionBudget:
    """How many lease-loss evictions this pass may still make (policy.eviction)."""

    def __init__(self, ctx: SchedulerContext, fleet: Fleet, now: dt.datetime) -> None:
        self.ctx, self.now = ctx, now.timestamp()
        self.limits = EvictionLimits(window_s=ctx.tuning.eviction_window_s)
        raw = ctx.blobs.get(keys.EVICTIONS)
        self.recent: list[float] = prune(json.loads(raw) if raw else [], self.now, self.limits)
        self.session = fleet.session
        self.sizes: tuple[int, int] | None = None  # counted when an eviction is first asked for

    def take(self) -> bool:
        if self.sizes is None:  # a pass changes no device's state: the database's counts
            self.sizes = store_ops.fleet_counts(self.session)
        fleet_size, not_ready = self.sizes
        if allowed_evictions(fleet_size, not_ready, self.recent, self.now, self.limits) <= 0:
            return False
        self.recent.append(self.now)
        return True

    def save(self) -> None:
        self.ctx.blobs.set(keys.EVICTIONS, json.dumps(self.recent).encode())


def keep_running(ctx: SchedulerContext, session: Session, job: Job, fleet: Fleet,
                 budget: EvictionBudget, now: dt.datetime, result: PassResult) -> None:
    req = PlacementRequest.for_job(job)
    holders = fleet.of(job.id)
    req = settle_running_class(session, job, req, holders, now)
    current = store_ops.primaries(session, job.id)
    leaving = {d.id for d in holders if not keepable(req, d)}
    # lease loss is rate limited (a network blip is not a dead fleet); pause/drain/cordon is not
    held_back = frozenset(i for i in sorted(leaving)
                          if fleet.by_id[i].state == DeviceState.NOT_READY and not budget.take())
    gone = leaving - held_back
    staying = [d for d in holders if d.id not in gone]
    complete = len(current) == req.shards and set(current.values()) <= {d.id for d in staying}
    if complete and not gone:
        if len(holders) < req.wanted_devices and fleet.any_free_fits(req):
            ctx.blobs.set(keys.rebalance(job.id), b"1")  # joins happen at the next boundary
        return
    plan = rebalance(req, staying, [], current, force_keep=held_back)
    if not plan.admitted:
        to_pending(session, job, plan.reason, now, "Waiting", result)
        fleet.free_job(job.id)
        return
    store_ops.drop_backups(session, job.id)
    moved = store_ops.set_primaries(session, job.id, plan.shards, since_step=job.step)
    fleet.assign(None, [d.id for d in holders if d.id not in plan.devices])
    result.moved[job.id] = moved
    events.record(
        session, "ShardsMoved",
        f"{len(moved)} shard(s) moved at step {job.step}"
        + (f" away from {', '.join(sorted(gone))}" if gone else ""),
        now=now, job_id=job.id,
        data={"shards": moved, "from": sorted(gone), "devices": list(plan.devices),
              "step": job.step, "counts": store_ops.shard_counts(plan.shards)},
    )


def settle_running_class(session: Session, job: Job, req: PlacementRequest,
                         holders: list[DeviceView], now: dt.datetime) -> PlacementRequest:
    """A running `class` job without a compute class (placed before jobs had one) settles on
    its holders' best class now; holders of another class then leave it like any other."""
    if not req.pinned or req.compute_class is not None:
        return req
    chosen = choose_compute_class(req, [d for d in holders if keepable(req, d)])
    if chosen is None:
        return req
    chose = StateEvent("ComputeClassChosen",
                       f"its shards stay on compute class #{chosen} from step {job.step}",
                       data={"compute_class": chosen, "step": job.step})
    if not update_job(session, job.id, expect={"state": JobState.RUNNING.value,
                                               "compute_class": None},
                      event=chose, now=now, compute_class=chosen):
        return req
    return replace(req, compute_class=chosen)


def to_pending(session: Session, job: Job, reason: str, now: dt.datetime, event: str,
               result: PassResult) -> None:
    """Back to Pending with its step kept; it resumes there when placed again."""
    paused = StateEvent(event, f"{reason}; paused at step {job.step}", "Warning",
                        {"step": job.step})
    if transition(session, job.id, JobState.PENDING, paused, now=now, expect={"step": job.step},
                  reason=reason):
        store_ops.release(session, job.id)
        result.waiting.append(job.id)


def place_pending(ctx: SchedulerContext, session: Session, job: Job, fleet: Fleet,
                  now: dt.datetime, result: PassResult) -> None:
    info, why = job_info_or_reason(job.id, job.spec, ctx.settings.data_dir)
    if info is None:
        store_ops.fail_job(session, job, why or "cannot run this spec", now)
        return
    req = PlacementRequest.for_job(job)
    usage = store_ops.user_usage(session, job.owner, fleet.all(), job.id)
    over = quota.refusal(job.owner, usage, ctx.user_limits, req.min_devices)
    if over is not None:  # never preempts: the user's own running jobs hold the room
        if job.reason != over:
            update_job(session, job.id, expect={"state": JobState.PENDING.value}, reason=over)
        return
    req = quota.within_limits(req, job.owner, usage, ctx.user_limits)
    plan = place_gang(req, fleet.all())
    if not plan.admitted:
        victims = plan_preemption(req, fleet.all(), running_jobs(session, fleet))
        for victim in victims:
            preempt(session, victim, job, fleet, now, result)
        if victims:
            plan = place_gang(req, fleet.all())
    if not plan.admitted:
        if job.reason != plan.reason:
            update_job(session, job.id, expect={"state": JobState.PENDING.value},
                       reason=plan.reason)
        return
    total = job.total_steps or info.total_steps
    data: dict[str, Any] = {"devices": list(plan.devices), "step": job.step,
                            "counts": store_ops.shard_counts(plan.shards)}
    pinned: dict[str, str] = {}  # a class job keeps the compute class its first placement chose
    if req.pinned and plan.compute_class is not None:
        pinned = {"compute_class": plan.compute_class}
        data["compute_class"] = plan.compute_class
    scheduled = StateEvent(
        "Scheduled", f"placed on {len(plan.devices)} device(s) at step {job.step}: "
        + ", ".join(f"{d}={n}" for d, n in sorted(store_ops.shard_counts(plan.shards).items()))
        + (f"; compute class #{plan.compute_class}" if pinned else ""), data=data)
    if not transition(session, job.id, JobState.RUNNING, scheduled, now=now,
                      expect={"step": job.step, "compute_class": job.compute_class},
                      reason=None, started_at=job.started_at or now, step_started_at=now,
                      total_steps=total, **pinned):
        return
    store_ops.set_primaries(session, job.id, plan.shards, since_step=job.step)
    fleet.assign(job.id, plan.devices)
    result.placed.append(job.id)


def running_jobs(session: Session, fleet: Fleet) -> list[RunningJob]:
    return [RunningJob(j.id, j.priority, frozenset(d.id for d in fleet.of(j.id)))
            for j in store_ops.jobs_in(session, [JobState.RUNNING.value])]


def preempt(session: Session, victim_id: str, by: Job, fleet: Fleet, now: dt.datetime,
            result: PassResult) -> None:
    victim = session.get(Job, victim_id)
    if victim is None or victim.state != JobState.RUNNING:
        return
    reason = f"preempted by {by.id} (priority {by.priority} > {victim.priority})"
    to_pending(session, victim, reason, now, "Preempted", result)
    fleet.free_job(victim_id)
    result.preempted.append(victim_id)
