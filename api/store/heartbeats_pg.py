"""The Postgres fast path for a heartbeat batch: two fixed statements whatever the batch size.

`UPDATE devices ... FROM unnest(arrays)` authenticates every heartbeat against its token row,
renews the leases and stores the latest sample, returning each device's state before and after;
then one `INSERT ... SELECT FROM unnest(arrays)` appends every sample. Arrays keep the SQL text
fixed (prepared once per connection) and leave the per-row work to psycopg's C adapters.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from sqlalchemy import insert, text
from sqlalchemy.orm import Session

from api.lifecycle import NOT_READY
from api.schemas.devices import HeartbeatIn
from api.store.events import event_row
from api.store.models import Event

RENEW = text("""
UPDATE devices AS d SET
  lease_renewed_at = :now, updated = :now,
  state = CASE WHEN d.draining THEN 'Draining' WHEN d.cordoned THEN 'Cordoned' ELSE 'Ready' END,
  pause_reason = v.pause,
  latest_telemetry = COALESCE(v.tel::json, d.latest_telemetry),
  latest_telemetry_at = COALESCE(v.tel_at, d.latest_telemetry_at),
  agent_version = COALESCE(v.agent_version, d.agent_version),
  capabilities = COALESCE(v.caps::json, d.capabilities),
  profiles = COALESCE(v.profiles::json, d.profiles)
FROM unnest(CAST(:ids AS text[]), CAST(:hashes AS text[]), CAST(:tel AS text[]),
            CAST(:tel_at AS timestamptz[]), CAST(:versions AS text[]), CAST(:caps AS text[]),
            CAST(:profiles AS text[]), CAST(:pause AS text[]))
       AS v(id, token_hash, tel, tel_at, agent_version, caps, profiles, pause),
     devices AS old, api_tokens AS t
WHERE d.id = v.id AND old.id = d.id AND t.token_hash = v.token_hash AND t.kind = 'device'
  AND t.device_id = v.id AND NOT t.revoked AND (t.expires_at IS NULL OR t.expires_at > :now)
RETURNING d.id, old.state AS old_state, old.pause_reason AS old_pause, d.cordoned, d.draining,
          d.profiles
""")

APPEND = text("""
INSERT INTO telemetry_samples (device_id, ts, battery_pct, charging, battery_temp_c, cpu_temp_c,
                               power_w, cpu_freq_mhz, throttled, busy, created, updated)
SELECT s.*, :now, :now FROM unnest(
  CAST(:device_id AS text[]), CAST(:ts AS timestamptz[]), CAST(:battery_pct AS float8[]),
  CAST(:charging AS bool[]), CAST(:battery_temp_c AS float8[]), CAST(:cpu_temp_c AS float8[]),
  CAST(:power_w AS float8[]), CAST(:cpu_freq_mhz AS float8[]), CAST(:throttled AS bool[]),
  CAST(:busy AS bool[])) AS s
""")
SAMPLE_FIELDS = ("battery_pct", "charging", "battery_temp_c", "cpu_temp_c", "power_w",
                 "cpu_freq_mhz", "throttled", "busy")


def _dumps(value: Any) -> str | None:
    return None if value is None else json.dumps(value)


def merged_per_device(items: list[tuple[str, str, HeartbeatIn]], latest) -> dict:
    """(device, token hash) -> the values to store: the newest sample, the last value sent."""
    merged: dict[tuple[str, str], dict[str, Any]] = {}
    for device_id, token_hash, body in items:
        row = merged.setdefault((device_id, token_hash), {"tel": None, "tel_ts": None,
                                                          "agent_version": None, "caps": None,
                                                          "profiles": None})
        newest = latest(body)
        if newest is not None and (row["tel_ts"] is None or newest["ts"] >= row["tel_ts"]):
            row["tel"], row["tel_ts"] = newest, newest["ts"]
        for key, value in (("agent_version", body.agent_version), ("caps", body.capabilities),
                           ("profiles", body.profiles)):
            if value is not None:
                row[key] = value
        row["pause"] = body.pause
    return merged


def renew(session: Session, merged: dict, now: dt.datetime) -> dict[str, Any]:
    """Run the authenticated bulk renewal; device id -> its returned row (absent: refused)."""
    keys = sorted(merged)  # id order: concurrent batches lock rows in the same order
    rows = [merged[key] for key in keys]
    params = {
        "now": now, "ids": [k[0] for k in keys], "hashes": [k[1] for k in keys],
        "tel": [_dumps(r["tel"]) for r in rows],
        "tel_at": [None if r["tel_ts"] is None else
                   dt.datetime.fromtimestamp(r["tel_ts"], dt.timezone.utc) for r in rows],
        "versions": [r["agent_version"] for r in rows], "caps": [_dumps(r["caps"]) for r in rows],
        "profiles": [_dumps(r["profiles"]) for r in rows],
        "pause": [r["pause"].reason if r["pause"] else None for r in rows],
    }
    return {row.id: row for row in session.execute(RENEW, params)}


def append_samples(session: Session, samples: list[tuple[str, Any]], now: dt.datetime) -> None:
    if not samples:
        return
    params: dict[str, Any] = {"now": now, "device_id": [d for d, _ in samples],
                              "ts": [s.ts for _, s in samples]}
    for name in SAMPLE_FIELDS:
        params[name] = [getattr(s, name) for _, s in samples]
    session.execute(APPEND, params)


def state_events(renewed: dict[str, Any], merged: dict, now: dt.datetime
                 ) -> tuple[list[dict[str, Any]], list[str]]:
    """NodeReady for a device that was NotReady; Paused/Resumed when the pause changed."""
    rows, changed = [], []
    for (device_id, _), values in merged.items():
        row = renewed.get(device_id)
        if row is None:
            continue
        if row.old_state == NOT_READY:
            rows.append(event_row("NodeReady", "heartbeat renewed the lease", now=now,
                                  device_id=device_id))
            changed.append(device_id)
        pause = values["pause"]
        if (pause.reason if pause else None) != row.old_pause:
            reason, msg = ("Paused", f"{pause.reason}: {pause.detail or ''}".rstrip(": ")) \
                if pause else ("Resumed", "the agent trains again")
            rows.append(event_row(reason, msg, now=now, device_id=device_id))
            changed.append(device_id)
    return rows, changed


def insert_events(session: Session, rows: list[dict[str, Any]]) -> None:
    if rows:
        session.execute(insert(Event.__table__), rows)
