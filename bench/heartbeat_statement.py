"""Postgres CPU of the heartbeat batch statement by batch size, the statement run alone.

    .venv/bin/python bench/heartbeat_statement.py [--sizes 1,4,16,64] [--devices 1000]

Creates a fresh database, registers N devices through a `phalanx server` (then stopped), and
runs `domain.store.heartbeats_pg.BATCH` from one connection with the writer's planner options,
batches of each size (3 samples per heartbeat, ~3,000 heartbeats per size). Prints the backend's
CPU (from /proc) per heartbeat and per statement, and the wall time per statement (the commit's
WAL flush included): what a batch costs Postgres whatever the HTTP side does.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import psycopg
from psycopg.rows import namedtuple_row

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from api.heartbeat_writer_pg import PLANNER_OPTIONS  # noqa: E402
from api.schemas.devices import HeartbeatIn  # noqa: E402
from bench.heartbeats import ADMIN, drop_database, fresh_database, register_devices  # noqa: E402
from domain.store import heartbeats_pg  # noqa: E402
from domain.store.db import libpq_url  # noqa: E402
from domain.store.tokens import hash_token  # noqa: E402
from tests.support.server import start_server  # noqa: E402


def backend_cpu_s(pid: int) -> float:
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def heartbeat(ts: float) -> HeartbeatIn:
    return HeartbeatIn.model_validate({"agent_version": "0.1.0", "telemetry": [
        {"ts": ts + j * 1e-4, "battery_pct": 81.5, "charging": False, "battery_temp_c": 33.1,
         "cpu_temp_c": 41.2, "power_w": 2.9, "cpu_freq_mhz": 1785.6, "throttled": False,
         "busy": False} for j in range(3)]})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,4,16,64")
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument("--database", default=os.environ.get(
        "PHALANX_TEST_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"))
    parser.add_argument("--redis", default=os.environ.get(
        "PHALANX_TEST_REDIS_URL", "redis://127.0.0.1:6379/14"))
    args = parser.parse_args()
    db_url = fresh_database(args.database)
    work = Path(tempfile.mkdtemp(prefix="phalanx-bench-"))
    try:
        server = start_server(database_url=db_url, data_dir=work / "data", admin_token=ADMIN,
                              redis_url=args.redis, args=["--workers", "1"])
        try:
            devices = [(device_id, hash_token(token))
                       for device_id, token in register_devices(server.url, args.devices)]
        finally:
            server.stop()
        with psycopg.connect(libpq_url(db_url), autocommit=True, options=PLANNER_OPTIONS,
                             row_factory=namedtuple_row) as conn:
            pid = conn.execute("SELECT pg_backend_pid()").fetchone()[0]
            sent, start = 0, time.time()
            for size in (int(s) for s in args.sizes.split(",")):
                statements = max(3, 3000 // size)
                cpu0, wall0 = backend_cpu_s(pid), time.perf_counter()
                for _ in range(statements):
                    items = []
                    for _ in range(size):
                        device_id, token_hash = devices[sent % len(devices)]
                        sent += 1
                        items.append((device_id, token_hash, heartbeat(start + sent * 1e-3)))
                    params = heartbeats_pg.batch_params(items, dt.datetime.now(dt.timezone.utc))
                    rows = conn.execute(heartbeats_pg.BATCH, params, prepare=True).fetchall()
                    assert len(rows) == size, (len(rows), size)
                cpu = backend_cpu_s(pid) - cpu0
                wall = time.perf_counter() - wall0
                print(f"batch {size:4d}: Postgres {cpu / (statements * size) * 1e6:6.1f} µs per "
                      f"heartbeat, {cpu / statements * 1e3:6.2f} ms per statement; wall "
                      f"{wall / statements * 1e3:6.2f} ms per statement", flush=True)
    finally:
        drop_database(db_url)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
