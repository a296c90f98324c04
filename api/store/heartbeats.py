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

from api.errors import Forbidden, Unauthorized
from api.schemas.devices import HeartbeatIn
from api.store.events import event_row
from api.store.lifecycle import NOT_READY, derive_state, leased_state_sql
from api.store.models import ApiToken, Device, Event, TelemetrySample

DEVICES = Device.__table__
SAMPLE_FIELDS = ("battery_pct", "charging", "battery_temp_c", "cpu_temp_c", "power_w",
                 "cpu_freq_mhz", "throttled", "busy")
OPTIONAL_COLUMNS = ("agent_version", "capabilities", "profiles")


class UnknownToken(Exception):
    """The hash matches no device token: the route decides between 401 and 403."""


@dataclass
class BatchOutcome:
    replies: list[dict[str, Any] | Exception]
    changed_devices: list[str] = field(default_factory=list)


def _sample_row(device_id: str, sample: Any, now: dt.datetime) -> dict[str, Any]:
    row = {name: getattr(sample, name) for name in SAMPLE_FIELDS}
    row.update(device_id=device_id, ts=sample.ts, created=now, updated=now)
    return row


def latest_sample(body: HeartbeatIn) -> dict[str, Any] | None:
    if not body.telemetry:
        return None
    newest = max(body.telemetry, key=lambda s: s.ts)
    values = newest.model_dump(exclude_none=True)
    values["ts"] = newest.ts.timestamp()
    return values


def _update_row(device_id: str, body: HeartbeatIn, now: dt.datetime) -> dict[str, Any]:
    row: dict[str, Any] = {"b_id": device_id, "lease_renewed_at": now, "updated": now,
                           "pause_reason": body.pause.reason if body.pause else None}
    latest = latest_sample(body)
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


def _authorize(token: Any, device_id: str, now: dt.datetime) -> Exception | None:
    """The heartbeat's bearer token, checked against the row read in this same transaction."""
    if token is None:
        return UnknownToken()
    if token.revoked:
        return Unauthorized("bearer token revoked")
    if token.expires_at is not None and token.expires_at <= now:
        return Unauthorized("bearer token expired")
    if token.device_id != device_id:
        return Forbidden("a device token may act only for its own device")
    return None


def read_batch(session: Session, items: list[tuple[str, str, HeartbeatIn]]) -> dict[str, Any]:
    """token hash -> its device row, for the whole batch in one query (auth and state at once)."""
    hashes = sorted({token_hash for _, token_hash, _ in items})
    query = (select(ApiToken.token_hash, ApiToken.revoked, ApiToken.expires_at,
                    ApiToken.device_id, Device.state, Device.cordoned, Device.draining,
                    Device.pause_reason, Device.profiles)
             .join(Device, Device.id == ApiToken.device_id)
             .where(ApiToken.token_hash.in_(hashes), ApiToken.kind == "device"))
    return {row.token_hash: row for row in session.execute(query)}


def apply_heartbeats(session: Session, items: list[tuple[str, str, HeartbeatIn]],
                     now: dt.datetime, *, grace_s: float, interval_s: float,
                     active_archs: frozenset[str] | set[str] = frozenset()) -> BatchOutcome:
    """items: (device id from the path, SHA-256 of the bearer token, body)."""
    rows = read_batch(session, items)
    outcome = BatchOutcome(replies=[])
    updates, samples, new_events = [], [], []
    seen_pause: dict[str, str | None] = {}
    for device_id, token_hash, body in items:
        device = rows.get(token_hash)
        refusal = _authorize(device, device_id, now)
        if refusal is not None:
            outcome.replies.append(refusal)
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
        outcome.replies.append(_reply(device_id, device, profiles, now, grace_s, interval_s,
                                      active_archs))
    if updates:  # in id order, so concurrent batches lock rows in the same order (no deadlock)
        _bulk_update(session, sorted(updates, key=lambda row: row["b_id"]))
    if samples:
        session.execute(insert(TelemetrySample.__table__), samples)
    if new_events:
        session.execute(insert(Event.__table__), new_events)
    outcome.changed_devices = sorted(set(outcome.changed_devices))
    return outcome


def _reply(device_id: str, device: Any, profiles: dict[str, Any], now: dt.datetime,
           grace_s: float, interval_s: float, active_archs: Any) -> dict[str, Any]:
    return {"device_id": device_id,
            "state": derive_state(True, device.cordoned, device.draining),
            "lease": {"renewed_at": now.isoformat(), "grace_s": grace_s},
            "heartbeat_interval_s": interval_s,
            "commands": _commands(device, profiles, active_archs)}


def batch_outcome(items: list[tuple[str, str, HeartbeatIn]], renewed: dict[str, Any],
                  why: dict[str, Any], now: dt.datetime, *, grace_s: float, interval_s: float,
                  active_archs: Any) -> BatchOutcome:
    """The replies to a batch run by `api.store.heartbeats_pg`: `renewed` maps each accepted
    device to its returned row; `why` holds the token rows of the refused ones."""
    changed = [row.id for row in renewed.values()
               if row.old_state == NOT_READY or row.pause != row.old_pause]
    outcome = BatchOutcome(replies=[], changed_devices=sorted(set(changed)))
    for device_id, token_hash, _ in items:
        row = renewed.get(device_id)
        if row is None:
            refusal = _authorize(why.get(token_hash), device_id, now)
            outcome.replies.append(refusal or Unauthorized("bearer token refused"))
        else:
            outcome.replies.append(_reply(device_id, row, row.profiles or {}, now, grace_s,
                                          interval_s, active_archs))
    return outcome
