"""The Postgres fast path for a heartbeat batch: one statement, one round trip, its own commit.

A single statement of data-modifying CTEs, run in autocommit (so the statement is the
transaction): `UPDATE devices ... FROM json_to_recordset(...)` authenticates every heartbeat against its
token row and renews the lease, storing the latest sample, capabilities, profiles and pause;
`INSERT ... SELECT FROM json_to_recordset(...)` appends the samples of the heartbeats it accepted; two
more INSERTs record the NodeReady and Paused/Resumed events. JSON parameters keep the SQL text
fixed (prepared once per connection) whatever the batch size; placeholders are psycopg's, for
the asyncio writer (api.heartbeat_writer_pg).
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from api.schemas.devices import HeartbeatIn
from api.store.heartbeats import latest_sample

BATCH = """
WITH v AS (
  SELECT * FROM json_to_recordset(CAST(%(devices)s AS json))
    AS v(id text, token_hash text, tel json, tel_at timestamptz, agent_version text, caps json,
         profiles json, pause text, pause_detail text)
), renewed AS (
  UPDATE devices AS d SET
    lease_renewed_at = %(now)s, updated = %(now)s,
    state = CASE WHEN d.draining THEN 'Draining' WHEN d.cordoned THEN 'Cordoned' ELSE 'Ready' END,
    pause_reason = v.pause,
    latest_telemetry = COALESCE(v.tel, d.latest_telemetry),
    latest_telemetry_at = COALESCE(v.tel_at, d.latest_telemetry_at),
    agent_version = COALESCE(v.agent_version, d.agent_version),
    capabilities = COALESCE(v.caps, d.capabilities),
    profiles = COALESCE(v.profiles, d.profiles)
  FROM v CROSS JOIN LATERAL (
         SELECT 1 FROM api_tokens AS t
         WHERE t.token_hash = v.token_hash AND t.kind = 'device' AND t.device_id = v.id
           AND NOT t.revoked AND (t.expires_at IS NULL OR t.expires_at > %(now)s) LIMIT 1) AS ok,
       devices AS old
  WHERE d.id = v.id AND old.id = d.id
  RETURNING d.id, old.state AS old_state, old.pause_reason AS old_pause, d.pause_reason AS pause,
            v.pause_detail, d.cordoned, d.draining, d.profiles
), appended AS (
  INSERT INTO telemetry_samples (device_id, ts, battery_pct, charging, battery_temp_c,
                                 cpu_temp_c, power_w, cpu_freq_mhz, throttled, busy, created,
                                 updated)
  SELECT x.id, s.ts, s.battery_pct, s.charging, s.battery_temp_c, s.cpu_temp_c, s.power_w,
         s.cpu_freq_mhz, s.throttled, s.busy, %(now)s, %(now)s
  FROM json_to_recordset(CAST(%(samples)s AS json)) AS x(id text, telemetry json),
       json_to_recordset(x.telemetry) AS s(ts timestamptz, battery_pct float8, charging bool,
                                           battery_temp_c float8, cpu_temp_c float8,
                                           power_w float8, cpu_freq_mhz float8, throttled bool,
                                           busy bool)
  WHERE x.id IN (SELECT id FROM renewed)
), ready AS (
  INSERT INTO events (ts, reason, message, device_id, kind, data, created, updated)
  SELECT %(now)s, 'NodeReady', 'heartbeat renewed the lease', id, 'Normal', '{}', %(now)s, %(now)s
  FROM renewed WHERE old_state = 'NotReady'
), paused AS (
  INSERT INTO events (ts, reason, message, device_id, kind, data, created, updated)
  SELECT %(now)s, CASE WHEN pause IS NULL THEN 'Resumed' ELSE 'Paused' END,
         CASE WHEN pause IS NULL THEN 'the agent trains again'
              ELSE pause || COALESCE(': ' || pause_detail, '') END,
         id, 'Normal', '{}', %(now)s, %(now)s
  FROM renewed WHERE pause IS DISTINCT FROM old_pause
)
SELECT * FROM renewed
"""


def merged_per_device(items: list[tuple[str, str, HeartbeatIn]]) -> dict:
    """(device, token hash) -> the values to store: the newest sample, the last value sent."""
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for device_id, token_hash, body in items:
        row = merged.setdefault((device_id, token_hash), {"tel": None, "tel_ts": None,
                                                          "agent_version": None, "caps": None,
                                                          "profiles": None})
        newest = latest_sample(body)
        if newest is not None and (row["tel_ts"] is None or newest["ts"] >= row["tel_ts"]):
            row["tel"], row["tel_ts"] = newest, newest["ts"]
        for key, value in (("agent_version", body.agent_version), ("caps", body.capabilities),
                           ("profiles", body.profiles)):
            if value is not None:
                row[key] = value
        row["pause"] = body.pause
    return merged


def batch_params(items: list[tuple[str, str, HeartbeatIn]], now: dt.datetime) -> dict:
    """The statement's parameters: two JSON documents (json_to_recordset): encoding them is C/Rust work, not per-value
    Python adaptation. Each body's samples are dumped by pydantic-core as they are."""
    merged = merged_per_device(items)
    devices = []
    for (device_id, token_hash) in sorted(merged):  # id order: batches lock rows in one order
        row = merged[(device_id, token_hash)]
        pause = row["pause"]
        devices.append({
            "id": device_id, "token_hash": token_hash, "tel": row["tel"],
            "tel_at": None if row["tel_ts"] is None else
            dt.datetime.fromtimestamp(row["tel_ts"], dt.timezone.utc).isoformat(),
            "agent_version": row["agent_version"], "caps": row["caps"],
            "profiles": row["profiles"], "pause": pause.reason if pause else None,
            "pause_detail": pause.detail if pause else None})
    samples = ",".join(
        '{"id":' + json.dumps(device_id) + "," + body.model_dump_json(include={"telemetry"})[1:]
        for device_id, _, body in items if body.telemetry)
    return {"now": now, "devices": json.dumps(devices), "samples": f"[{samples}]"}


async def apply_batch_async(conn: Any, items: list[tuple[str, str, HeartbeatIn]],
                            now: dt.datetime) -> dict[str, Any]:
    """Run the batch on an autocommit psycopg AsyncConnection (the statement commits itself);
    device id -> its returned row. A device absent from the result was refused (bad, revoked or
    foreign token; deleted)."""
    cursor = await conn.execute(BATCH, batch_params(items, now), prepare=True)
    return {row.id: row for row in await cursor.fetchall()}
