"""The Postgres writer of the heartbeat rules (`domain.store.heartbeats`): one statement, one
round trip, its own commit.

A single statement of data-modifying CTEs, run in autocommit (so the statement is the
transaction): `UPDATE devices ... FROM json_to_recordset(...)` authenticates each merged
device batch against its own token row and renews the lease, storing the latest sample,
capabilities, profiles and pause; `INSERT ... SELECT` appends the samples of the (device, token)
pairs it accepted; two more INSERTs record the NodeReady and Paused/Resumed events. Every rule
in it is compiled from its one expression in `domain.store.heartbeats` (the token that may
heartbeat, the latest sample, the state, the events' conditions, the active architectures) and
the event texts come in as parameters. JSON parameters keep the SQL text fixed (prepared once per
connection) whatever the batch size; placeholders are psycopg's, for the asyncio writer
(api.heartbeat_writer_pg).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from pydantic_core import to_json
from sqlalchemy import ClauseElement, func, literal_column
from sqlalchemy.dialects import postgresql

from domain.store.heartbeats import (
    NODE_READY,
    TOKENS,
    HeartbeatIn,
    active_archs_query,
    came_back,
    latest_telemetry_values,
    merge_batch,
    pause_changed,
    pause_event,
    token_live,
    token_owns,
)
from domain.store.lifecycle import leased_state_sql


def sql(expression: ClauseElement) -> str:
    """An expression as Postgres text, its constants inline."""
    return str(expression.compile(dialect=postgresql.psycopg.dialect(),
                                  compile_kwargs={"literal_binds": True}))


def _column(name: str) -> ClauseElement:
    return literal_column(name)


_t = TOKENS.alias("t")
_latest = latest_telemetry_values(_column("v.tel"), _column("v.tel_at"))
STATE = sql(leased_state_sql())
TOKEN_ACCEPTS = (sql(token_live(_t, _column("now_")))
                 + " AND " + sql(token_owns(_t.c.device_id, _column("v.id")))
                 ).replace("now_", "%(now)s")  # the statement's parameter
LATEST = {name: sql(value) for name, value in _latest.items()}
CAME_BACK = sql(came_back(_column("old_state")))
PAUSE_CHANGED = sql(pause_changed(func.coalesce(_column("old_pause"), ""),
                                  func.coalesce(_column("pause"), "")))
ACTIVE_ARCHS = sql(active_archs_query())

BATCH = """
WITH v AS (
  SELECT * FROM json_to_recordset(CAST(%(devices)s AS json))
    AS v(id text, token_hash text, tel json, tel_at timestamptz, agent_version text, caps json,
         profiles json, pause text, pause_event text, pause_message text)
), renewed AS (
  UPDATE devices SET
    lease_renewed_at = %(now)s, updated = %(now)s,
    state = """ + STATE + """,
    pause_reason = v.pause,
    latest_telemetry = """ + LATEST["latest_telemetry"] + """,
    latest_telemetry_at = """ + LATEST["latest_telemetry_at"] + """,
    agent_version = COALESCE(v.agent_version, devices.agent_version),
    capabilities = COALESCE(v.caps, devices.capabilities),
    profiles = COALESCE(v.profiles, devices.profiles)
  FROM v CROSS JOIN LATERAL (
         SELECT t.created, t.expires_at FROM api_tokens AS t
         WHERE t.token_hash = v.token_hash AND """ + TOKEN_ACCEPTS + """ LIMIT 1) AS ok,
       devices AS old
  WHERE devices.id = v.id AND old.id = devices.id
  RETURNING devices.id, v.token_hash, old.state AS old_state, old.pause_reason AS old_pause,
            devices.pause_reason AS pause, v.pause_event, v.pause_message, devices.cordoned,
            devices.draining, devices.profiles, devices.logs_requested_at, devices.upgrade_to,
            ok.created AS token_created,
            ok.expires_at AS token_expires_at
), appended AS (
  INSERT INTO telemetry_samples (device_id, ts, battery_pct, charging, battery_temp_c,
                                 cpu_temp_c, power_w, cpu_freq_mhz, throttled, busy, created,
                                 updated)
  SELECT x.id, s.ts, s.battery_pct, s.charging, s.battery_temp_c, s.cpu_temp_c, s.power_w,
         s.cpu_freq_mhz, s.throttled, s.busy, %(now)s, %(now)s
  FROM json_to_recordset(CAST(%(samples)s AS json))
         AS x(id text, token_hash text, telemetry json),
       json_to_recordset(x.telemetry) AS s(ts timestamptz, battery_pct float8, charging bool,
                                           battery_temp_c float8, cpu_temp_c float8,
                                           power_w float8, cpu_freq_mhz float8, throttled bool,
                                           busy bool)
  WHERE (x.id, x.token_hash) IN (SELECT id, token_hash FROM renewed)
), ready AS (
  INSERT INTO events (ts, reason, message, device_id, kind, data, created, updated)
  SELECT %(now)s, %(ready_reason)s, %(ready_message)s, id, 'Normal', '{}', %(now)s, %(now)s
  FROM renewed WHERE """ + CAME_BACK + """
), paused AS (
  INSERT INTO events (ts, reason, message, device_id, kind, data, created, updated)
  SELECT %(now)s, pause_event, pause_message, id, 'Normal', '{}', %(now)s, %(now)s
  FROM renewed WHERE """ + PAUSE_CHANGED + """
)
SELECT * FROM renewed
"""


def batch_params(items: list[tuple[str, str, HeartbeatIn]], now: dt.datetime) -> dict:
    """The statement's parameters: two JSON documents (json_to_recordset), each encoded by one
    call of pydantic-core (Rust) over the whole batch, the validated samples as they are: per
    heartbeat a few µs, against ~45 µs for json.dumps and a model_dump_json per body
    (docs/benchmarks.md)."""
    devices = []
    merged = sorted(merge_batch(items), key=lambda e: (e.device_id, e.token_hash))
    for entry in merged:  # id order: concurrent batches lock rows in one order
        event, message = pause_event(entry.pause)
        devices.append({
            "id": entry.device_id, "token_hash": entry.token_hash, "tel": entry.latest,
            "tel_at": None if entry.latest is None else
            dt.datetime.fromtimestamp(entry.latest["ts"], dt.timezone.utc),
            "agent_version": entry.agent_version, "caps": entry.capabilities,
            "profiles": entry.profiles, "pause": entry.pause_reason,
            "pause_event": event, "pause_message": message})
    samples = [{"id": device_id, "token_hash": token_hash, "telemetry": body.telemetry}
               for device_id, token_hash, body in items if body.telemetry]
    return {"now": now, "devices": to_json(devices).decode(), "samples": to_json(samples).decode(),
            "ready_reason": NODE_READY[0], "ready_message": NODE_READY[1]}


async def apply_batch_async(conn: Any, items: list[tuple[str, str, HeartbeatIn]],
                            now: dt.datetime) -> dict[str, Any]:
    """Run the batch on an autocommit psycopg AsyncConnection (the statement commits itself);
    (device id, token hash) -> its returned row. A pair absent from the result was refused
    (bad, revoked or foreign token; deleted device)."""
    cursor = await conn.execute(BATCH, batch_params(items, now), prepare=True)
    return {(row.id, row.token_hash): row for row in await cursor.fetchall()}
