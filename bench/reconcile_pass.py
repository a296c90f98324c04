"""A steady reconcile pass at 10,000, 50,000 and 100,000 devices (issue 45 item 1): the
placement pass with a 138-phone gang running and nothing pending, as reconcile runs it every
2 s, and the stale-lease sweep beside it.

    source scripts/services.sh && ensure_services
    .venv/bin/python bench/reconcile_pass.py [--fleets 10000,50000,100000] [--repeats 5]

For each fleet size a fresh Postgres database is filled as bench/placement_100k.py fills it
(swarm phones' rows, one statement), the gang submitted through the API and placed by one
committed pass. Then, alternated pass by pass in the same minutes:
- lazy: `placement_pass` as it is (the holders read; the free fleet only when needed);
- whole: the same pass made to read every device view first, as it did before (the baseline);
each in a transaction rolled back, with this process's CPU time beside the wall time (the
CPU time is the scheduler's part on a core of its own; Postgres's own work is in the wall time
only), and `mark_stale_devices` (one UPDATE; Postgres's work) timed alone, every lease
renewed just before (a fleet whose phones heartbeat: nothing to mark).
Printed: one JSON object per fleet size, then a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from placement_100k import ADMIN, fill_devices, scratch_database, submit_gang  # noqa: E402


def median_ms(xs: list[float]) -> float:
    return round(1000 * statistics.median(xs), 1)


def measure(settings: Any, repeats: int) -> dict[str, Any]:
    from sqlalchemy import update

    from domain.store.lifecycle import mark_stale_devices
    from domain.store.models import Device
    from roots.worker import build_context
    from scheduler.tasks import placement

    ctx = build_context(settings)
    job_id = submit_gang(settings)
    with ctx.session_factory.begin() as session:
        placed = placement.placement_pass(ctx, session, ctx.clock())
    assert placed.placed == [job_id], placed

    class WholeFleet(placement.Fleet):  # the baseline: every device view read at the start
        def __init__(self, session: Any) -> None:
            super().__init__(session)
            self.all()

    lazy_fleet = placement.Fleet
    times: dict[str, list[float]] = {"lazy": [], "whole": [], "lazy_cpu": [], "whole_cpu": [],
                                     "stale": []}
    for _ in range(repeats):
        for name, fleet in (("lazy", lazy_fleet), ("whole", WholeFleet)):
            placement.Fleet = fleet  # type: ignore[misc]
            try:
                with ctx.session_factory() as session:
                    session.begin()
                    t0, c0 = time.perf_counter(), time.process_time()
                    result = placement.placement_pass(ctx, session, ctx.clock())
                    times[name].append(time.perf_counter() - t0)
                    times[f"{name}_cpu"].append(time.process_time() - c0)
                    session.rollback()
            finally:
                placement.Fleet = lazy_fleet  # type: ignore[misc]
            assert not result.changed, result  # steady: nothing to place or move
        with ctx.session_factory.begin() as session:  # the phones' heartbeats, untimed
            session.execute(update(Device).values(lease_renewed_at=ctx.clock()))
        with ctx.session_factory() as session:
            session.begin()
            t0 = time.perf_counter()
            mark_stale_devices(session, ctx.clock(), settings.lease_grace_s)
            times["stale"].append(time.perf_counter() - t0)
            session.rollback()
    return {k: median_ms(v) for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fleets", default="10000,50000,100000")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--pg-url", default=os.environ.get(
        "PHALANX_TEST_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"))
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/8")
    args = parser.parse_args()

    from domain.settings import Settings

    rows = []
    for n in (int(x) for x in args.fleets.split(",")):
        with scratch_database(args.pg_url, "recon") as db_url:
            fill_devices(db_url, n)
            settings = Settings(database_url=db_url, redis_url=args.redis_url,
                                admin_token=ADMIN,
                                data_dir=Path(tempfile.mkdtemp(prefix="phalanx-recon-")))
            got = {"devices": n, **measure(settings, args.repeats),
                   "load": [round(x, 2) for x in os.getloadavg()]}
        print(json.dumps(got), flush=True)
        rows.append(got)
    print("| devices | pass, lazy: wall | CPU | pass, whole fleet: wall | CPU | "
          "CPU whole / lazy | stale sweep (Postgres) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['devices']:,} | {r['lazy']} ms | {r['lazy_cpu']} ms | {r['whole']} ms | "
              f"{r['whole_cpu']} ms | {r['whole_cpu'] / max(r['lazy_cpu'], 0.1):.0f}x | "
              f"{r['stale']} ms |")


if __name__ == "__main__":
    main()
