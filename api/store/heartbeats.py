"""Applying a batch of heartbeats in one transaction (the group-commit writer calls this).

One SELECT reads the devices of the batch; one executemany per column set renews the leases and
stores the latest sample, capabilities, profiles and pause; one bulk INSERT appends every sample
to the history; events are inserted only for real changes (NotReady -> Ready, pause changes).
"""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import bindparam, insert, select, update
from sqlalchemy.orm import Session

from api.errors import Unauthorized
from api.lifecycle import NOT_READY, derive_state, leased_state_sql
from api.schemas.devices import HeartbeatIn
from api.store.events import event_row
from api.store.models import Device, Event, TelemetrySample

DEVICES = Device.__table__
SAMPLE_FIELDS = ("battery_pct", "charging", "battery_temp_c", "cpu_temp_c", "power_w",
                 "cpu_freq_mhz", "throttled", "busy")
OPTIONAL_COLUMNS = ("agent_version", "capabilities", "profiles")


@dataclass
class BatchOutcome:
    replies: list[dict[str, Any] | Exception]
    changed_devices: list[str] = field(default_factory=list)


def _sample_row(device_id: str, sample: Any, now: dt.datetime) -> dict[str, Any]:
    row = {name: getattr(sample, name) for name in SAMPLE_FIELDS}
    row.update(device_id=device_id, ts=sample.ts, created=now, updated=now)
    return row


def _latest(body: HeartbeatIn) -> dict[str, Any] | None:
    if not body.telemetry:
        return None
    newest = max(body.telemetry, key=lambda s: s.ts)
    values = newest.model_dump(exclude_none=True)
    values["ts"] = newest.ts.timestamp()
    return values


def _update_row(device_id: str, body: HeartbeatIn, now: dt.datetime) -> dict[str, Any]:
    row: dict[str, Any] = {"b_id": device_id, "lease_renewed_at": now, "updated": now,
                           "pause_reason": body.pause.reason if body.pause else None}
    latest = _latest(body)
    if latest is not None:
        row["latest_telemetry"] = latest
        row["latest_telemetry_at"] = dt.datetime.fromtimestamp(latest["ts"], dt.timezone.utc)
    for name in OPTIONAL_COLUMNS:
        value = getattr(body, name)
        if value is not None:
            row[name] = value
    return row


def _bulk_update(session: Session, rows: list[dict[str, Any]]) -> None:
    """executemany grouped by column set; state is computed on the row (see leased_state_sql)."""
    groups: dict[tuple[str, ...], list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(tuple(sorted(row)), []).append(row)
    for keys, group in groups.items():
        values: dict[str, Any] = {
            k: bindparam(k, type_=DEVICES.c[k].type) for k in keys if k != "b_id"
        }
        values["state"] = leased_state_sql()
        stmt = update(DEVICES).where(DEVICES.c.id == bindparam("b_id")).values(values)
        session.connection().execute(stmt, group)


def _commands(device: Any, profiles: dict[str, Any], active_archs: set[str]) -> list[dict]:
    commands: list[dict[str, Any]] = []
    if device.draining:
        commands.append({"type": "drain"})
    missing = sorted(a for a in active_archs if a not in profiles)
    if missing and not device.draining:
        commands.append({"type": "profile", "arch": missing[0]})  # one at a time
    return commands


def apply_heartbeats(session: Session, items: list[tuple[str, HeartbeatIn]], now: dt.datetime,
                     *, grace_s: float, interval_s: float,
                     active_archs: set[str] = frozenset()) -> BatchOutcome:  # type: ignore[assignment]
    ids = sorted({device_id for device_id, _ in items})
    current = {row.id: row for row in session.execute(
        select(Device.id, Device.state, Device.cordoned, Device.draining, Device.pause_reason,
               Device.profiles).where(Device.id.in_(ids))
    )}
    outcome = BatchOutcome(replies=[])
    updates, samples, new_events = [], [], []
    seen_pause: dict[str, str | None] = {}
    for device_id, body in items:
        device = current.get(device_id)
        if device is None:
            outcome.replies.append(Unauthorized(f"device {device_id} was deleted"))
            continue
        updates.append(_update_row(device_id, body, now))
        samples.extend(_sample_row(device_id, s, now) for s in body.telemetry)
        pause = body.pause.reason if body.pause else None
        before = seen_pause.get(device_id, device.pause_reason)
        if device.state == NOT_READY and device_id not in seen_pause:
            new_events.append(event_row("NodeReady", "heartbeat renewed the lease", now=now,
                                        device_id=device_id))
            outcome.changed_devices.append(device_id)
        if pause != before:
            reason, msg = ("Paused", f"{pause}: {body.pause.detail or ''}".rstrip(": ")) \
                if body.pause else ("Resumed", "the agent trains again")
            new_events.append(event_row(reason, msg, now=now, device_id=device_id))
            outcome.changed_devices.append(device_id)
        seen_pause[device_id] = pause
        profiles = body.profiles if body.profiles is not None else device.profiles or {}
        outcome.replies.append({
            "device_id": device_id,
            "state": derive_state(True, device.cordoned, device.draining),
            "lease": {"renewed_at": now.isoformat(), "grace_s": grace_s},
            "heartbeat_interval_s": interval_s,
            "commands": _commands(device, profiles, active_archs),
        })
    if updates:
        _bulk_update(session, updates)
    if samples:
        session.execute(insert(TelemetrySample.__table__), samples)
    if new_events:
        session.execute(insert(Event.__table__), new_events)
    outcome.changed_devices = sorted(set(outcome.changed_devices))
    return outcome
