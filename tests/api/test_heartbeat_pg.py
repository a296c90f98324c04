"""The Postgres heartbeat writer (asyncio, one statement per batch): its connections survive
a dropped backend, and its batch statement stays on index plans as the fleet grows."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from api.heartbeat_writer_pg import PLANNER_OPTIONS
from api.schemas.devices import HeartbeatIn
from domain.store import heartbeats_pg
from domain.store.db import libpq_url
from domain.store.models import TelemetrySample
from domain.store.tokens import hash_token
from tests.api.conftest import Api, api_on, sample


@pytest.fixture
def pg_api(pg_url: str, tmp_path: Path) -> Iterator[Api]:
    with api_on(pg_url, tmp_path) as started:
        yield started


def _kill_writer_backends(url: str) -> int:
    """pg_terminate_backend every connection of the writer (they carry its planner options)."""
    with psycopg.connect(libpq_url(url), autocommit=True) as admin:
        rows = admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = "
            "current_database() AND pid <> pg_backend_pid() AND query LIKE '%json_to_recordset%'"
        ).fetchall()
    return len(rows)


def test_a_killed_database_connection_loses_no_heartbeat(pg_api, pg_url):
    device = pg_api.register()
    assert pg_api.heartbeat(device, {"telemetry": [sample(1.0)]}).status_code == 200
    assert _kill_writer_backends(pg_url) >= 1
    # the next batch fails on the dead connection, is retried on a fresh one, and commits
    resp = pg_api.heartbeat(device, {"telemetry": [sample(2.0), sample(3.0)]})
    assert resp.status_code == 200, resp.text
    assert pg_api.count(TelemetrySample) == 3
    latest = pg_api.get(f"/v1/devices/{device['device_id']}").json()["latest_telemetry"]
    assert latest["ts"] == 3.0


def test_the_batch_statement_uses_indexes_not_table_scans(pg_api, pg_url):
    devices = [pg_api.register(f"p{i}") for i in range(60)]
    with psycopg.connect(libpq_url(pg_url), autocommit=True, options=PLANNER_OPTIONS) as conn:
        conn.execute("ANALYZE devices; ANALYZE api_tokens")
        items = [(d["device_id"], hash_token(d["device_token"]),
                  HeartbeatIn.model_validate({"telemetry": [sample(10.0)]})) for d in devices[:2]]
        params = heartbeats_pg.batch_params(items, dt.datetime.now(dt.timezone.utc))
        plan = "\n".join(row[0] for row in conn.execute(
            "EXPLAIN " + heartbeats_pg.BATCH, params).fetchall())
    # a table scan per batch would make every heartbeat cost O(fleet)
    assert "Seq Scan" not in plan, plan
    assert "pk_devices" in plan, plan


def test_the_batch_parameters_carry_every_validated_value_as_model_dump_gives_it():
    """batch_params encodes the whole batch in one pydantic-core call (not json.dumps and a
    model_dump_json per body): the documents must still say what the models say, None fields,
    a naive timestamp made UTC and a batch's two heartbeats of one device included."""
    import json

    from domain.store.heartbeats import latest_sample

    bodies = [HeartbeatIn.model_validate(
        {"telemetry": [sample(5.0), {**sample(7.25), "battery_pct": None, "throttled": True},
                       {"ts": "2026-01-02T03:04:05.123456", "busy": False}],
         "agent_version": "1.2.3", "pause": {"reason": "charging", "detail": "plugged in"}}),
        HeartbeatIn.model_validate({"telemetry": [sample(1.5)]})]
    items = [("dev-a", "hash-a", bodies[0]), ("dev-b", "hash-b", bodies[1]),
             ("dev-a", "hash-a", HeartbeatIn.model_validate({"telemetry": []}))]
    now = dt.datetime(2026, 12, 7, 12, 0, tzinfo=dt.timezone.utc)
    params = heartbeats_pg.batch_params(items, now)
    samples = json.loads(params["samples"])
    assert samples == [{"id": device_id, "token_hash": token_hash,
                        **json.loads(body.model_dump_json(include={"telemetry"}))}
                       for device_id, token_hash, body in items if body.telemetry]
    devices = {d["id"]: d for d in json.loads(params["devices"])}
    assert list(devices) == ["dev-a", "dev-b"]  # id order: batches lock rows in one order
    newest = max(bodies[0].telemetry, key=lambda s: s.ts)
    expected = {**newest.model_dump(exclude_none=True), "ts": newest.ts.timestamp()}
    assert latest_sample(bodies[0]) == expected
    assert devices["dev-a"]["tel"] == expected
    assert dt.datetime.fromisoformat(devices["dev-a"]["tel_at"]) == \
        dt.datetime.fromtimestamp(newest.ts.timestamp(), dt.timezone.utc)
    # the later heartbeat of dev-a says nothing of a pause (resumed) and no version (kept)
    assert devices["dev-a"]["pause"] is None and devices["dev-a"]["agent_version"] == "1.2.3"
    assert devices["dev-b"]["pause"] is None and devices["dev-b"]["tel"]["ts"] == 1.5
