"""The scheduler's store queries (take a session, flush, never commit: the caller owns the
transaction). A job's row is written only through domain.store.states (`transition`,
`update_job`: guarded, they return whether they won, so racing tasks change a row once) and
events only through domain.store.events."""

from __future__ import annotations

import datetime as dt
import math
from collections import defaultdict
from collections.abc import Collection, Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

from sqlalchemy import delete, exists, func, select
from sqlalchemy.orm import Session

from domain.store.compute_class import fingerprint_of
from domain.store.models import Device, Job, ShardAssignment
from domain.store.states import Event as StateEvent
from domain.store.states import transition
from scheduler.policy.quota import Usage
from scheduler.policy.types import MAX_SPEED, DeviceView
from wire.states import FINISHED_STATES, DeviceState, JobState

TERMINAL = FINISHED_STATES
TEMP_RANGE = (-50.0, 200.0)  # a telemetry sample's temperatures (the heartbeat's schema)
MAX_CORES = 1024  # a device spec's cpu_cores (the registration's schema)
IN_BATCH = 1000  # ids a query names at once, devices it reads at once


def _number(value: Any, low: float = -math.inf, high: float = math.inf) -> float | None:
    """A stored number: None unless a finite int or float (a bool is no number) in [low, high]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:  # an int past any float
        return None
    return number if math.isfinite(number) and low <= number <= high else None


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _names(value: Any) -> frozenset[str] | None:
    """A stored list of names: None (the agent did not say) unless it is a list; of a list, its
    strings (anything else in it is no name)."""
    return frozenset(v for v in value if isinstance(v, str)) if isinstance(value, list) else None


def stored_speeds(profiles: Any) -> dict[str, float]:
    """arch -> measured samples/s, from a stored `profiles` column: a speed that is not a
    finite number in (0, MAX_SPEED] is none (the estimate from the core count stands in)."""
    speeds = {}
    for arch, profile in _mapping(profiles).items():
        speed = _number(_mapping(profile).get("samples_per_s"), 0.0, MAX_SPEED)
        if isinstance(arch, str) and speed:
            speeds[arch] = speed
    return speeds


def device_view(device: Device, job_id: str | None) -> DeviceView:
    """What placement may know of a device. The JSON columns (capabilities, profiles,
    telemetry, spec, labels) hold what a phone or an older server wrote: nothing of them is
    trusted to have its type; a part that is not what the schemas say counts as absent."""
    tel = _mapping(device.latest_telemetry)
    temps = [t for t in (_number(tel.get("cpu_temp_c"), *TEMP_RANGE),
                         _number(tel.get("battery_temp_c"), *TEMP_RANGE)) if t is not None]
    caps = _mapping(device.capabilities)
    spec = _mapping(device.spec)
    cores = _number(spec.get("cpu_cores"), 1, MAX_CORES)
    return DeviceView(
        id=device.id,
        state=device.state,
        cordoned=bool(device.cordoned),
        draining=bool(device.draining),
        pause_reason=device.pause_reason,
        labels=MappingProxyType({k: v for k, v in _mapping(device.labels).items()
                                 if isinstance(k, str) and isinstance(v, str)}),
        battery_pct=_number(tel.get("battery_pct"), 0.0, 100.0),
        charging=tel.get("charging") if isinstance(tel.get("charging"), bool) else None,
        temp_c=max(temps) if temps else None,
        archs=_names(caps.get("archs")),
        backends=_names(caps.get("backends")),
        features=_names(caps.get("features")) or frozenset(),
        cpu_cores=int(cores) if cores else 4,
        ram_mb=_number(spec.get("ram_mb"), 0.0, math.inf) or None,
        speeds=MappingProxyType(stored_speeds(device.profiles)),
        job_id=job_id,
        upgrading=device.upgrade_to is not None,
        compute_class=fingerprint_of(caps),
    )


def device_jobs(session: Session) -> dict[str, str]:
    """device id -> the job it holds shards of (primary or backup)."""
    rows = session.execute(select(ShardAssignment.device_id, ShardAssignment.job_id).distinct())
    return {device: job for device, job in rows}


def all_device_views(session: Session) -> list[DeviceView]:
    holds = device_jobs(session)
    devices = session.scalars(select(Device).order_by(Device.id))
    return [device_view(d, holds.get(d.id)) for d in devices]


def held_device_views(session: Session, holds: Mapping[str, str]) -> list[DeviceView]:
    """The views of the devices in `holds` (device id -> its job): the holders of every job,
    read by primary key, without the free fleet."""
    ids = sorted(holds)
    views: list[DeviceView] = []
    for start in range(0, len(ids), IN_BATCH):
        chunk = ids[start:start + IN_BATCH]
        views += [device_view(d, holds[d.id]) for d in
                  session.scalars(select(Device).where(Device.id.in_(chunk)))]
    return views


def free_device_views(session: Session, skip: Collection[str]) -> Iterator[list[DeviceView]]:
    """The devices that hold no job and are not in `skip`, Ready and uncordoned (the only
    ones any filter lets through: policy.filters), by id, IN_BATCH at a time: a caller looking
    for one that fits stops reading at the first batch that has it."""
    query = (select(Device).where(Device.state == DeviceState.READY.value,
                                  Device.cordoned.is_(False),
                                  ~exists().where(ShardAssignment.device_id == Device.id))
             .order_by(Device.id))
    after = ""
    while True:
        rows = list(session.scalars(query.where(Device.id > after).limit(IN_BATCH)))
        if not rows:
            return
        after = rows[-1].id
        views = [device_view(d, None) for d in rows if d.id not in skip]
        if views:
            yield views


def fleet_counts(session: Session) -> tuple[int, int]:
    """(devices, of them NotReady), counted by the database (the eviction limit's inputs)."""
    total, not_ready = session.execute(select(
        func.count(), func.count().filter(Device.state == DeviceState.NOT_READY.value)
    ).select_from(Device)).one()
    return int(total), int(not_ready)


def primaries(session: Session, job_id: str) -> dict[int, str]:
    rows = session.execute(
        select(ShardAssignment.shard, ShardAssignment.device_id).where(
            ShardAssignment.job_id == job_id, ShardAssignment.role == "primary"
        )
    )
    return {int(shard): device for shard, device in rows}


def backups(session: Session, job_id: str) -> dict[int, str]:
    rows = session.execute(
        select(ShardAssignment.shard, ShardAssignment.device_id).where(
            ShardAssignment.job_id == job_id, ShardAssignment.role == "backup"
        )
    )
    return {int(shard): device for shard, device in rows}


def auditors(session: Session, job_id: str, step: int) -> dict[int, frozenset[str]]:
    """shard -> the devices computing it again for an audit of `step` (scheduler.audits)."""
    rows = session.execute(
        select(ShardAssignment.shard, ShardAssignment.span, ShardAssignment.device_id).where(
            ShardAssignment.job_id == job_id, ShardAssignment.role.in_(("audit", "decide")),
            ShardAssignment.since_step == step))
    out: dict[int, set[str]] = defaultdict(set)
    for shard, span, device in rows:
        for k in range(int(shard), int(shard) + int(span or 1)):
            out[k].add(device)
    return {k: frozenset(v) for k, v in out.items()}


def holdings(session: Session, device_id: str) -> tuple[str | None, list[int]]:
    """The job a device works for and every shard it holds there (primary and backup)."""
    rows = session.execute(
        select(ShardAssignment.job_id, ShardAssignment.shard)
        .where(ShardAssignment.device_id == device_id)
        .order_by(ShardAssignment.job_id, ShardAssignment.shard)
    ).all()
    if not rows:
        return None, []
    job_id = rows[0][0]
    return job_id, sorted({int(s) for j, s in rows if j == job_id})


def set_primaries(session: Session, job_id: str, mapping: Mapping[int, str], since_step: int) -> list[int]:
    """Make the job's primary assignments equal `mapping`, touching only shards that moved."""
    rows = {
        a.shard: a
        for a in session.scalars(
            select(ShardAssignment).where(
                ShardAssignment.job_id == job_id, ShardAssignment.role == "primary"
            )
        )
    }
    moved: list[int] = []
    for shard, device in mapping.items():
        row = rows.pop(shard, None)
        if row is None:
            session.add(ShardAssignment(job_id=job_id, shard=shard, device_id=device,
                                        role="primary", since_step=since_step))
            moved.append(shard)
        elif row.device_id != device:
            row.device_id, row.since_step = device, since_step
            moved.append(shard)
    for row in rows.values():
        session.delete(row)
    session.flush()
    return sorted(moved)


def add_backups(session: Session, job_id: str, plan: Mapping[int, str], step: int) -> None:
    for shard, device in plan.items():
        session.add(ShardAssignment(job_id=job_id, shard=shard, device_id=device,
                                    role="backup", since_step=step))
    session.flush()


def drop_backups(session: Session, job_id: str) -> int:
    result = session.execute(
        delete(ShardAssignment).where(
            ShardAssignment.job_id == job_id, ShardAssignment.role == "backup"
        )
    )
    return int(result.rowcount or 0)


def release(session: Session, job_id: str) -> int:
    result = session.execute(delete(ShardAssignment).where(ShardAssignment.job_id == job_id))
    return int(result.rowcount or 0)


def user_usage(session: Session, owner: str | None, views: Iterable[DeviceView],
               except_job: str) -> Usage:
    """What `owner`'s other running jobs hold: how many, and how many devices together."""
    if owner is None:
        return Usage()
    running = set(session.scalars(select(Job.id).where(
        Job.owner == owner, Job.state == JobState.RUNNING.value, Job.id != except_job)))
    return Usage(len(running), sum(1 for d in views if d.job_id in running))


def jobs_in(session: Session, states: Iterable[str]) -> list[Job]:
    return list(
        session.scalars(
            select(Job).where(Job.state.in_(list(states))).order_by(
                Job.priority.desc(), Job.created, Job.id
            )
        )
    )


def jobs_with_assignments(session: Session) -> list[str]:
    return sorted(session.scalars(select(ShardAssignment.job_id).distinct()))


def shards_by_device(mapping: Mapping[int, str]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = defaultdict(list)
    for shard, device in sorted(mapping.items()):
        out[device].append(shard)
    return dict(out)


def shard_counts(mapping: Mapping[int, str]) -> dict[str, int]:
    return {device: len(shards) for device, shards in shards_by_device(mapping).items()}


def fail_job(session: Session, job: Job, reason: str, now: dt.datetime) -> bool:
    """Running or Pending -> Failed with a reason; releases its shards. True if it changed."""
    won = transition(session, job.id, JobState.FAILED, StateEvent(JobState.FAILED.value, reason, "Warning"),
                     now=now, reason=reason, finished_at=now)
    if won:
        release(session, job.id)
    return won
