"""The heartbeat rules are written once (domain.store.heartbeats) and run by two writers: SQLite's
transaction and Postgres' single statement (domain.store.heartbeats_pg). One batch fed to both
must leave the same rows and events and get the same replies: lease renewals, a NotReady device
coming back, a pause lifted, a pause set and lifted within the batch, a throttled sample, older
samples after newer ones, and refused tokens (revoked, expired, another device's, forged)."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

import psycopg
from psycopg.rows import namedtuple_row
from sqlalchemy import select

from api.schemas.devices import HeartbeatIn
from domain.store import heartbeats, heartbeats_pg
from domain.store.db import libpq_url, make_engine, make_session_factory, transaction
from domain.store.models import ApiToken, Device, Event, TelemetrySample
from domain.store.tokens import hash_token

NOW = dt.datetime(2026, 12, 4, 12, 0, tzinfo=dt.timezone.utc)
BEFORE = NOW - dt.timedelta(minutes=5)
OPTIONS = {"grace_s": 40.0, "interval_s": 10.0, "active_archs": {"mlp"}}
DEVICES = {  # id: state, cordoned, draining, pause
    "dev-a": ("Ready", False, False, None),
    "dev-b": ("NotReady", False, False, None),
    "dev-c": ("Ready", False, False, "thermal"),
    "dev-d": ("Draining", True, True, None),
    "dev-e": ("Ready", False, False, None),
}
TOKENS = {  # secret: device, revoked, expires
    "phx-dev-a": ("dev-a", False, None),
    "phx-dev-b": ("dev-b", False, None),
    "phx-dev-c": ("dev-c", False, None),
    "phx-dev-c-old": ("dev-c", False, BEFORE),
    "phx-dev-d": ("dev-d", False, None),
    "phx-dev-e": ("dev-e", True, None),
}


def seed(url: str) -> None:
    with transaction(make_session_factory(make_engine(url))) as s:
        for device_id, (state, cordoned, draining, pause) in DEVICES.items():
            s.add(Device(id=device_id, name=device_id, state=state, cordoned=cordoned,
                         draining=draining, pause_reason=pause, lease_renewed_at=BEFORE,
                         profiles={"cnn": {"samples_per_s": 5.0}}))
        s.flush()
        for secret, (device_id, revoked, expires) in TOKENS.items():
            s.add(ApiToken(kind="device", name=secret, token_hash=hash_token(secret),
                           device_id=device_id, revoked=revoked, expires_at=expires))


def sample(seconds_ago: float, **values: Any) -> dict[str, Any]:
    return {"ts": (NOW - dt.timedelta(seconds=seconds_ago)).timestamp(), **values}


def batch() -> list[tuple[str, str, HeartbeatIn]]:
    beats = [
        ("dev-a", "phx-dev-a", {"telemetry": [sample(20, cpu_temp_c=50.0)], "agent_version": "1.0",
                                "pause": {"reason": "thermal", "detail": "cpu 50 C > 45"}}),
        ("dev-a", "phx-forged", {"telemetry": [sample(15, battery_pct=1.0)],
                                 "pause": {"reason": "battery"}}),
        ("dev-a", "phx-dev-a", {"telemetry": [sample(30, cpu_temp_c=41.0)],
                                "profiles": {"mlp": {"samples_per_s": 9.0}}}),
        ("dev-b", "phx-dev-b", {"telemetry": [sample(5, battery_pct=80.0, charging=True)],
                                "capabilities": {"backends": ["numpy"]}}),
        ("dev-c", "phx-dev-c", {"telemetry": []}),
        ("dev-c", "phx-dev-c-old", {"telemetry": [sample(1, cpu_temp_c=99.0)]}),
        ("dev-d", "phx-dev-d", {"telemetry": [sample(2, throttled=True, cpu_freq_mhz=900.0)]}),
        ("dev-e", "phx-dev-e", {"telemetry": [sample(3)]}),
        ("dev-b", "phx-dev-a", {"telemetry": [sample(4, battery_pct=2.0)]}),
    ]
    return [(device_id, hash_token(secret), HeartbeatIn.model_validate(body))
            for device_id, secret, body in beats]


def run_sqlite(url: str) -> heartbeats.BatchOutcome:
    with transaction(make_session_factory(make_engine(url))) as session:
        return heartbeats.apply_heartbeats(session, batch(), NOW, **OPTIONS)


def run_postgres(url: str) -> heartbeats.BatchOutcome:
    items = batch()

    async def statement() -> dict[tuple[str, str], Any]:
        conn = await psycopg.AsyncConnection.connect(libpq_url(url), autocommit=True,
                                                     row_factory=namedtuple_row)
        try:
            return await heartbeats_pg.apply_batch_async(conn, items, NOW)
        finally:
            await conn.close()

    renewed = asyncio.run(statement())
    refused = [item for item in items if (item[0], item[1]) not in renewed]
    with make_session_factory(make_engine(url))() as session:
        why = heartbeats.read_batch(session, refused, NOW)
    return heartbeats.batch_outcome(items, renewed, why, NOW, **OPTIONS)


def utc(value: dt.datetime | None) -> float | None:
    if value is None:
        return None
    return (value if value.tzinfo else value.replace(tzinfo=dt.timezone.utc)).timestamp()


def stored(url: str) -> dict[str, Any]:
    """Everything a heartbeat may write, in a form both databases give alike."""
    with make_session_factory(make_engine(url))() as s:
        devices = {d.id: (d.state, utc(d.lease_renewed_at), d.pause_reason, d.latest_telemetry,
                          utc(d.latest_telemetry_at), d.agent_version, d.capabilities, d.profiles)
                   for d in s.scalars(select(Device))}
        samples = sorted((t.device_id, utc(t.ts), t.battery_pct, t.charging, t.cpu_temp_c,
                          t.cpu_freq_mhz, t.throttled) for t in s.scalars(select(TelemetrySample)))
        events = sorted((e.device_id, e.reason, e.message, utc(e.ts))
                        for e in s.scalars(select(Event)))
    return {"devices": devices, "samples": samples, "events": events}


def replies(outcome: heartbeats.BatchOutcome) -> list[Any]:
    return [(type(r).__name__, str(r)) if isinstance(r, Exception) else r for r in outcome.replies]


def test_one_batch_gives_the_same_rows_events_and_replies_on_both_writers(
        sqlite_url: str, pg_url: str) -> None:
    seed(sqlite_url)
    seed(pg_url)
    lite, pg = run_sqlite(sqlite_url), run_postgres(pg_url)
    assert replies(lite) == replies(pg)
    assert lite.changed_devices == pg.changed_devices
    assert stored(sqlite_url) == stored(pg_url)

    # and what they agree on is the rules
    got = replies(lite)
    assert [r[0] if isinstance(r, tuple) else "ok" for r in got] == [
        "ok", "UnknownToken", "ok", "ok", "ok", "Unauthorized", "ok", "Unauthorized", "Forbidden"]
    assert got[6]["state"] == "Draining" and got[6]["commands"] == [{"type": "drain"}]
    assert got[0]["commands"] == []  # the batch brought dev-a's mlp profile
    assert got[3]["commands"] == [{"type": "profile", "arch": "mlp"}]
    rows = stored(sqlite_url)
    a = rows["devices"]["dev-a"]
    assert a[0] == "Ready" and a[1] == NOW.timestamp() and a[2] is None  # pause set, then lifted
    assert a[3]["cpu_temp_c"] == 50.0  # the newest sample by its time, not the last sent
    assert rows["devices"]["dev-e"][1] == BEFORE.timestamp()  # revoked: no lease renewal
    assert [s[0] for s in rows["samples"]] == ["dev-a", "dev-a", "dev-b", "dev-d"]
    assert not any(s[2] in (1.0, 2.0) or s[4] == 99.0 for s in rows["samples"])  # refused ones
    assert [(e[0], e[1], e[2]) for e in rows["events"]] == [
        ("dev-b", "NodeReady", "heartbeat renewed the lease"),
        ("dev-c", "Resumed", "the agent trains again")]
    assert lite.changed_devices == ["dev-b", "dev-c"]
