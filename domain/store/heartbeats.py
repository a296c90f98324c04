"""The heartbeat rules, once, and the SQLite writer's transaction.

A heartbeat with a sample dated in the future (a phone's clock set wrong) is refused
(`check_clock`, before it is queued). A batch (the group commit's) is merged per device and
token (`merge_batch`): the newest sample by its timestamp becomes the device's latest unless
the stored one is newer (the latest only moves forward), the last value
sent of the agent version, capabilities, profiles and pause is kept, and every sample goes to
the history. Then, per merged device whose token is valid for it: the lease is renewed, the
state derived (`domain.store.lifecycle`), a `NodeReady` event recorded when it was NotReady, and a
`Paused`/`Resumed` event when the batch's last pause differs from the stored one. A heartbeat
is answered by its own token's verdict: a forged token riding along with a real one is refused.

Each rule is written once, below, as an expression both writers run: the token that may
heartbeat (`token_live`, `token_owns`), the latest sample moving only forward
(`latest_telemetry_values`), the state (`domain.store.lifecycle.leased_state_sql`), the events
(`came_back`, `pause_changed`: on values here, on columns in the Postgres statement) and the
active architectures (`active_archs_query`). `apply_heartbeats` below runs them through
SQLAlchemy on SQLite (one SELECT, one executemany per column set, bulk INSERTs);
`domain.store.heartbeats_pg` compiles them into its one Postgres statement.
tests/api/test_heartbeat_writers.py feeds one batch to both and compares every row and event.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from sqlalchemy import (
    ColumnElement,
    Select,
    TableClause,
    and_,
    bindparam,
    case,
    func,
    insert,
    not_,
    or_,
    select,
    update,
)
from sqlalchemy.orm import Session
from sqlalchemy.sql.expression import Alias

from domain.errors import Forbidden, Invalid, Unauthorized
from domain.store.events import event_row
from domain.store.lifecycle import NOT_READY, derive_state, leased_state_sql
from domain.store.models import ApiToken, Device, Event, Job, TelemetrySample
from wire.states import ACTIVE_STATES

DEVICES = Device.__table__
TOKENS = ApiToken.__table__
# the batch's time: a bound value here, the statement's parameter in Postgres
NOW = bindparam("now", type_=TOKENS.c.expires_at.type)
SAMPLE_FIELDS = ("battery_pct", "charging", "battery_temp_c", "cpu_temp_c", "power_w",
                 "cpu_freq_mhz", "throttled", "busy")
OPTIONAL_COLUMNS = ("agent_version", "capabilities", "profiles")


class Dumped(Protocol):
    """A parsed part of a request body (pydantic's): the store reads it without converting it,
    which would cost the hot path a copy per heartbeat."""

    def model_dump(self, **options: Any) -> dict[str, Any]: ...


class Sample(Dumped, Protocol):
    ts: dt.datetime


class Pause(Protocol):
    reason: str
    detail: str | None


class HeartbeatIn(Protocol):
    """What a heartbeat's body carries (api.schemas.devices.HeartbeatIn is one)."""

    telemetry: Sequence[Sample]
    agent_version: str | None
    capabilities: Dumped | None
    profiles: Mapping[str, Dumped] | None
    pause: Pause | None

    def model_dump_json(self, **options: Any) -> str: ...


class UnknownToken(Exception):
    """The hash matches no device token: the route decides between 401 and 403."""


@dataclass
class BatchOutcome:
    replies: list[dict[str, Any] | Exception]
    changed_devices: list[str] = field(default_factory=list)


# A phone's clock is trusted only this far ahead of the server's. A sample from the future
# would become the device's latest until its clock caught up, and never be pruned; the past is
# accepted (an agent buffers through an outage): it never moves the latest back, and pruning
# drops it once it is older than the retention.
MAX_CLOCK_AHEAD_S = 300.0


def check_clock(body: HeartbeatIn, now: dt.datetime) -> None:
    """Invalid, naming the first sample dated more than MAX_CLOCK_AHEAD_S after `now`."""
    latest = now + dt.timedelta(seconds=MAX_CLOCK_AHEAD_S)
    for i, sample in enumerate(body.telemetry):
        if sample.ts > latest:
            raise Invalid(f"telemetry.{i}.ts",
                          f"{sample.ts.isoformat()} is ahead of the server's clock "
                          f"({now.isoformat()}) by more than {MAX_CLOCK_AHEAD_S:g} s: "
                          "set the phone's clock")


# ---- the rules, each once: run on SQLite below, compiled into the Postgres statement ----

def token_live(token: TableClause | Alias, now: Any = NOW) -> ColumnElement[bool]:
    """A device token that may heartbeat now: not revoked, not past the end of its grace."""
    return and_(token.c.kind == "device", not_(token.c.revoked),
                or_(token.c.expires_at.is_(None), token.c.expires_at > now))


def token_owns(token_device_id: Any, device_id: Any) -> Any:
    """A device token acts only for its own device (values, or columns)."""
    return token_device_id == device_id


def latest_telemetry_values(sample: Any, sample_at: Any) -> dict[str, ColumnElement[Any]]:
    """The device's latest sample only ever moves forward in time (a buffered old sample goes
    to the history, not over a newer latest); no sample keeps the stored one."""
    stored, stored_at = DEVICES.c.latest_telemetry, DEVICES.c.latest_telemetry_at
    newer = or_(stored_at.is_(None), stored_at < sample_at)
    return {"latest_telemetry": case((newer, func.coalesce(sample, stored)), else_=stored),
            "latest_telemetry_at": case((newer, func.coalesce(sample_at, stored_at)),
                                        else_=stored_at)}


def came_back(old_state: Any) -> Any:
    """A NodeReady event: the lease renewed a device that was NotReady (a value or a column)."""
    return old_state == NOT_READY


def pause_changed(old_reason: Any, new_reason: Any) -> Any:
    """A Paused or Resumed event: the pause reason changed. On values `!=` is IS DISTINCT FROM;
    SQL callers pass both sides through COALESCE(_, '') (a reason is never empty)."""
    return old_reason != new_reason


def active_archs_query() -> Select[Any]:
    """The archs of Pending and Running jobs: a device with no profile for one is asked for it."""
    arch = Job.spec[("model", "arch")].as_string()
    return select(arch.label("arch")).distinct().where(Job.state.in_(ACTIVE_STATES))


NODE_READY = ("NodeReady", "heartbeat renewed the lease")
RESUMED = ("Resumed", "the agent trains again")


def pause_event(pause: Pause | None) -> tuple[str, str]:
    """The event for a changed pause: Paused with its reason and detail, or Resumed."""
    if pause is None:
        return RESUMED
    return "Paused", f"{pause.reason}: {pause.detail}" if pause.detail else pause.reason


@dataclass
class DeviceBatch:
    """One device's heartbeats of a batch (under one token), merged."""

    device_id: str
    token_hash: str
    samples: list[Any] = field(default_factory=list)
    latest: dict[str, Any] | None = None
    agent_version: str | None = None
    capabilities: dict[str, Any] | None = None
    profiles: dict[str, Any] | None = None
    pause: Pause | None = None

    @property
    def pause_reason(self) -> str | None:
        return self.pause.reason if self.pause else None


def latest_sample(body: HeartbeatIn) -> dict[str, Any] | None:
    if not body.telemetry:
        return None
    newest = max(body.telemetry, key=_sample_ts)
    # the sample's fields as validated (floats, bools; no nested models), as model_dump(
    # exclude_none=True) gives them at a tenth of its cost; a test compares the two
    values = {name: value for name, value in newest.__dict__.items() if value is not None}
    values["ts"] = newest.ts.timestamp()
    return values


def _sample_ts(sample: Any) -> dt.datetime:
    return sample.ts


def merge_batch(items: list[tuple[str, str, HeartbeatIn]]) -> list[DeviceBatch]:
    """The batch per (device, token), in the order of first arrival."""
    merged: dict[tuple[str, str], DeviceBatch] = {}
    for device_id, token_hash, body in items:
        entry = merged.setdefault((device_id, token_hash), DeviceBatch(device_id, token_hash))
        entry.samples.extend(body.telemetry)
        newest = latest_sample(body)
        if newest is not None and (entry.latest is None or newest["ts"] >= entry.latest["ts"]):
            entry.latest = newest
        for name in OPTIONAL_COLUMNS:
            value = getattr(body, name)
            if value is not None:
                setattr(entry, name, value)
        # columns of JSON: the typed parts as plain values, as sent (unknown keys dropped)
        if body.capabilities is not None:
            entry.capabilities = body.capabilities.model_dump(mode="json", exclude_unset=True)
        if body.profiles is not None:
            entry.profiles = {arch: profile.model_dump(mode="json", exclude_unset=True)
                              for arch, profile in body.profiles.items()}
        entry.pause = body.pause
    return list(merged.values())


def _sample_row(device_id: str, sample: Any, now: dt.datetime) -> dict[str, Any]:
    row = {name: getattr(sample, name) for name in SAMPLE_FIELDS}
    row.update(device_id=device_id, ts=sample.ts, created=now, updated=now)
    return row


def _update_row(entry: DeviceBatch, now: dt.datetime) -> dict[str, Any]:
    row: dict[str, Any] = {"b_id": entry.device_id, "lease_renewed_at": now, "updated": now,
                           "pause_reason": entry.pause_reason}
    if entry.latest is not None:
        row["latest_telemetry"] = entry.latest
        row["latest_telemetry_at"] = dt.datetime.fromtimestamp(entry.latest["ts"], dt.timezone.utc)
    for name in OPTIONAL_COLUMNS:
        value = getattr(entry, name)
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
        if "latest_telemetry" in values:
            values.update(latest_telemetry_values(values["latest_telemetry"],
                                                  values["latest_telemetry_at"]))
        values["state"] = leased_state_sql()
        stmt = update(DEVICES).where(DEVICES.c.id == bindparam("b_id")).values(values)
        session.connection().execute(stmt, group)


def _commands(device: Any, profiles: dict[str, Any], active_archs: set[str],
              rotate: bool) -> list[dict]:
    commands: list[dict[str, Any]] = []
    if device.draining:
        commands.append({"type": "drain"})
    measured = profiles if isinstance(profiles, dict) else {}  # a stored value: any JSON
    missing = sorted(a for a in active_archs if a not in measured)
    if missing and not device.draining:
        commands.append({"type": "profile", "arch": missing[0]})  # one at a time
    if rotate:
        commands.append({"type": "rotate_token"})
    if device.logs_requested_at is not None:  # until the agent ships them
        commands.append({"type": "logs"})
    if device.upgrade_to and not device.draining:  # until it heartbeats with that version
        commands.append(upgrade_command(device.upgrade_to))
    return commands


AGENT_ARCHIVE_PATH = "/agent.tar.gz"


def upgrade_command(target: dict[str, Any]) -> dict[str, Any]:
    """Install this agent build: fetched from any replica at `url`, checked against `sha256`."""
    return {"type": "upgrade", "version": target.get("version"), "sha256": target.get("sha256"),
            "url": AGENT_ARCHIVE_PATH}


def token_due(created: dt.datetime | None, expires_at: dt.datetime | None, now: dt.datetime,
              max_age_s: float) -> bool:
    """Whether a device token should be replaced: older than the maximum age and not yet
    superseded. A token already given an end has been rotated: it cannot rotate again (409,
    issue 42 item 7), so it is not asked to; it works until its grace ends."""
    if expires_at is not None:
        return False
    return created is not None and (now - created).total_seconds() >= max_age_s


def _authorize(token: Any, device_id: str) -> Exception | None:
    """The verdict on a heartbeat's bearer token (`read_batch`'s row, whose `live` the query
    computed with `token_live`), and why it is refused."""
    if token is None:
        return UnknownToken()
    if not token.live:
        return Unauthorized("bearer token revoked" if token.revoked else "bearer token expired")
    if not token_owns(token.device_id, device_id):
        return Forbidden("a device token may act only for its own device")
    return None


def read_batch(session: Session, items: list[tuple[str, str, HeartbeatIn]],
               now: dt.datetime) -> dict[str, Any]:
    """token hash -> its device row, for the whole batch in one query (auth and state at once)."""
    hashes = sorted({token_hash for _, token_hash, _ in items})
    query = (select(ApiToken.token_hash, ApiToken.revoked, token_live(TOKENS).label("live"),
                    ApiToken.created.label("token_created"), ApiToken.expires_at,
                    ApiToken.device_id, Device.state, Device.cordoned, Device.draining,
                    Device.pause_reason, Device.profiles, Device.logs_requested_at,
                    Device.upgrade_to)
             .join(Device, Device.id == ApiToken.device_id)
             .where(ApiToken.token_hash.in_(hashes), ApiToken.kind == "device"))
    return {row.token_hash: row for row in session.execute(query, {"now": now})}


def apply_heartbeats(session: Session, items: list[tuple[str, str, HeartbeatIn]],
                     now: dt.datetime, *, grace_s: float, interval_s: float,
                     active_archs: frozenset[str] | set[str] = frozenset(),
                     token_max_age_s: float = float("inf")) -> BatchOutcome:
    """items: (device id from the path, SHA-256 of the bearer token, body)."""
    rows = read_batch(session, items, now)
    changed: list[str] = []
    verdicts: dict[tuple[str, str], dict[str, Any] | Exception] = {}
    updates, samples, new_events = [], [], []
    for entry in merge_batch(items):
        device = rows.get(entry.token_hash)
        refusal = _authorize(device, entry.device_id)
        if refusal is not None:
            verdicts[(entry.device_id, entry.token_hash)] = refusal
            continue
        updates.append(_update_row(entry, now))
        samples.extend(_sample_row(entry.device_id, s, now) for s in entry.samples)
        if came_back(device.state):
            new_events.append(event_row(*NODE_READY, now=now, device_id=entry.device_id))
            changed.append(entry.device_id)
        if pause_changed(device.pause_reason, entry.pause_reason):
            new_events.append(event_row(*pause_event(entry.pause), now=now,
                                        device_id=entry.device_id))
            changed.append(entry.device_id)
        profiles = entry.profiles if entry.profiles is not None else device.profiles or {}
        verdicts[(entry.device_id, entry.token_hash)] = _reply(
            entry.device_id, device, profiles, now, grace_s, interval_s, active_archs,
            token_due(device.token_created, device.expires_at, now, token_max_age_s))
    if updates:  # in id order, so concurrent batches lock rows in the same order (no deadlock)
        _bulk_update(session, sorted(updates, key=lambda row: row["b_id"]))
    if samples:
        session.execute(insert(TelemetrySample.__table__), samples)
    if new_events:
        session.execute(insert(Event.__table__), new_events)
    return BatchOutcome(replies=[verdicts[(device_id, token_hash)]
                                 for device_id, token_hash, _ in items],
                        changed_devices=sorted(set(changed)))


def _reply(device_id: str, device: Any, profiles: dict[str, Any], now: dt.datetime,
           grace_s: float, interval_s: float, active_archs: Any, rotate: bool) -> dict[str, Any]:
    return {"device_id": device_id,
            "state": derive_state(True, device.cordoned, device.draining),
            "lease": {"renewed_at": now.isoformat(), "grace_s": grace_s},
            "heartbeat_interval_s": interval_s,
            "commands": _commands(device, profiles, active_archs, rotate)}


def batch_outcome(items: list[tuple[str, str, HeartbeatIn]], renewed: dict[tuple[str, str], Any],
                  why: dict[str, Any], now: dt.datetime, *, grace_s: float, interval_s: float,
                  active_archs: Any, token_max_age_s: float = float("inf")) -> BatchOutcome:
    """The replies to a batch run by `domain.store.heartbeats_pg`: `renewed` maps each accepted
    (device, token hash) to its returned row; `why` holds the token rows of the refused ones."""
    changed = [row.id for row in renewed.values()
               if came_back(row.old_state) or pause_changed(row.old_pause, row.pause)]
    outcome = BatchOutcome(replies=[], changed_devices=sorted(set(changed)))
    for device_id, token_hash, _ in items:
        row = renewed.get((device_id, token_hash))
        if row is None:
            refusal = _authorize(why.get(token_hash), device_id)
            outcome.replies.append(refusal or Unauthorized("bearer token refused"))
        else:
            outcome.replies.append(_reply(
                device_id, row, row.profiles or {}, now, grace_s, interval_s, active_archs,
                token_due(row.token_created, row.token_expires_at, now, token_max_age_s)))
    return outcome
