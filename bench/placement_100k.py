"""The placement pass with a 138-phone gang pending in a fleet of 100,000 devices (issue 45 item 5).

    source scripts/services.sh && ensure_services
    .venv/bin/python bench/placement_100k.py [--devices 100000] [--repeats 7] [--profile]

A fresh Postgres database gets `--devices` device rows written as the swarm's phones leave them
(bench/fleet_100k.py runs the same timing on the rows its 100,000 phones really wrote): Ready,
the hardware spec of a simulated profile, the capabilities a fresh agent heartbeats (compute
class included), one telemetry sample (battery 30-100%, 80% charging, CPU 28-47 °C), labels.
A job asking for exactly 138 devices and 552 shards is submitted through the API (in process),
and the placement pass runs as reconcile runs it, `placement_pass(ctx, session, now)` with a
context from `roots.worker.build_context`, in a transaction rolled back after each run. Timed
apart (three times): reading the fleet's device views (`store_ops.all_device_views`) and the
pure policy (`place_gang`) on them. Each with this process's CPU time beside the wall time:
on a shared machine the CPU time says what the pass costs on a core of its own (Postgres's
part excluded). `--profile`: cProfile of one more pass, the top functions by
cumulative time. Target (issue 45): < 200 ms.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from domain.store.db import libpq_url, upgrade  # noqa: E402
from wire.states import DeviceState, JobState  # noqa: E402

ADMIN = "phx-adm-place-" + uuid.uuid4().hex
GANG_SPEC = {
    "name": "gang-138", "model": {"arch": "mlp", "hidden": 16},
    "dataset": "synthetic:1x8x8:10:55200", "global_batch_size": 1104, "shards": 552,
    "epochs": 1, "seed": 1,
    "optimizer": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.0, "schedule": "cosine"},
    "placement": {"min_devices": 138, "max_devices": 138}, "priority": 0,
}


@contextlib.contextmanager
def scratch_database(pg_url: str, prefix: str) -> Iterator[str]:
    """A fresh database on `pg_url`'s server, migrated; dropped on the way out."""
    db = f"{prefix}_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(libpq_url(pg_url), autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{db}"')
        try:
            db_url = pg_url.rpartition("/")[0] + "/" + db
            upgrade(db_url)
            yield db_url
        finally:
            admin.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')


def fill_devices(db_url: str, n: int) -> None:
    """`n` device rows as heartbeating swarm phones leave them, written by one statement."""
    from agent import __version__
    from phalanx.sim.profiles import fleet_mix
    from phalanx.sim.swarm import heartbeat_tail

    body = json.loads(b'{"telemetry":[' + heartbeat_tail())
    specs = sorted({json.dumps(p.hardware_spec()) for p in fleet_mix(64)})
    with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:
        conn.execute(
            """
            INSERT INTO devices (id, name, labels, spec, state, cordoned, draining,
                lease_renewed_at, agent_version, capabilities, profiles, latest_telemetry,
                latest_telemetry_at)
            SELECT 'dev-' || lpad(g::text, 8, '0'), 'fill-' || g,
                json_build_object('sim', 'fill', 'rack', 'r' || (g %% 50)),
                (%(specs)s::json[])[1 + g %% array_length(%(specs)s::json[], 1)],
                %(ready)s, false, false, now(), %(version)s, %(caps)s::json, '{}'::json,
                json_build_object('ts', extract(epoch from now()),
                    'battery_pct', round((30 + random() * 70)::numeric, 1),
                    'charging', random() < 0.8,
                    'battery_temp_c', round((26 + random() * 19)::numeric, 1),
                    'cpu_temp_c', round((28 + random() * 19)::numeric, 1),
                    'power_w', 1.5, 'cpu_freq_mhz', 1785.6, 'throttled', false, 'busy', false),
                now()
            FROM generate_series(1, %(n)s) AS g
            """,
            {"specs": specs, "ready": DeviceState.READY.value, "version": __version__,
             "caps": json.dumps(body["capabilities"]), "n": n})
        conn.execute("ANALYZE devices")


def submit_gang(settings: Any) -> str:
    """The gang job, submitted through the API in this process (no worker runs it)."""
    from fastapi.testclient import TestClient

    from roots.api import create_app

    with TestClient(create_app(settings)) as client:
        resp = client.post("/v1/jobs", json=GANG_SPEC, headers={"Authorization": f"Bearer {ADMIN}"})
    if resp.status_code != 201:
        raise SystemExit(f"job refused: {resp.status_code} {resp.text[:400]}")
    return str(resp.json()["id"])


def ms(xs: list[float]) -> dict[str, float]:
    return {"median": round(1000 * statistics.median(xs), 1), "min": round(1000 * min(xs), 1),
            "max": round(1000 * max(xs), 1)}


def time_placement(settings: Any, job_id: str, repeats: int, profile: bool = False
                   ) -> dict[str, Any]:
    """The placement pass as reconcile runs it, `repeats` times, each rolled back; its parts."""
    from roots.worker import build_context
    from scheduler import store_ops
    from scheduler.policy.placement import place_gang
    from scheduler.policy.types import PlacementRequest
    from scheduler.tasks.placement import placement_pass

    ctx = build_context(settings)
    load0 = os.getloadavg()
    passes, reads, policy, placed, gang, fleet = [], [], [], False, 0, 0
    cpu_passes, cpu_reads = [], []  # this process's CPU: what a pass costs on a core of its own

    def one_pass() -> bool:
        with ctx.session_factory() as session:
            session.begin()
            result = placement_pass(ctx, session, ctx.clock())
            session.rollback()
        return result.placed == [job_id]

    for k in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        placed = one_pass()
        passes.append(time.perf_counter() - t0)
        cpu_passes.append(time.process_time() - c0)
        if k >= 3:  # the parts three times: enough to say where the time goes
            continue
        with ctx.session_factory() as session:
            t0, c0 = time.perf_counter(), time.process_time()
            views = store_ops.all_device_views(session)
            reads.append(time.perf_counter() - t0)
            cpu_reads.append(time.process_time() - c0)
            job = store_ops.jobs_in(session, [JobState.PENDING.value])[0]
            req = PlacementRequest.for_job(job)
            t0 = time.perf_counter()
            plan = place_gang(req, views)
            policy.append(time.perf_counter() - t0)
            gang, fleet = len(plan.devices), len(views)
    out: dict[str, Any] = {
        "job": job_id, "devices_in_table": fleet, "placed": placed, "gang": gang,
        "repeats": repeats, "pass_ms": ms(passes), "read_device_views_ms": ms(reads),  # 3 runs
        "place_gang_ms": ms(policy), "pass_cpu_ms": ms(cpu_passes),
        "read_device_views_cpu_ms": ms(cpu_reads), "load_before": load0,
        "load_after": os.getloadavg()}
    if profile:
        prof = cProfile.Profile()
        prof.enable()
        one_pass()
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(30)
        out["profile"] = text.getvalue()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--pg-url", default=os.environ.get(
        "PHALANX_TEST_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"))
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/8")
    args = parser.parse_args()

    from domain.settings import Settings

    with scratch_database(args.pg_url, "place") as db_url:
        t0 = time.perf_counter()
        fill_devices(db_url, args.devices)
        filled = time.perf_counter() - t0
        settings = Settings(database_url=db_url, redis_url=args.redis_url, admin_token=ADMIN,
                            data_dir=Path(tempfile.mkdtemp(prefix="phalanx-place-")))
        result = time_placement(settings, submit_gang(settings), args.repeats, args.profile)
        result["fill_s"] = round(filled, 1)
    profile = result.pop("profile", None)
    if profile:
        print(profile, file=sys.stderr)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
