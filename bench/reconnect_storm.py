"""A reconnect storm at fleet scale: every API replica restarted at once under N phones.

    .venv/bin/python bench/reconnect_storm.py [--phones 10000] [--sims 4] [--replicas 2]
                                               [--interval 10] [--settle 60]

Starts a fresh Postgres database (PHALANX_TEST_DATABASE_URL's server), Redis
(PHALANX_TEST_REDIS_URL), `--replicas` `phalanx server` processes and one `phalanx worker
--beat`; then `--sims` `phalanx sim` processes (one Python process saturates first), half of
them on each replica, enrolling `--phones` simulated phones that heartbeat every `--interval`
seconds with the real agent's backoff (full jitter, 30 s cap). Once every phone has
heartbeated, both replicas are SIGKILLed and started again on the same ports at once. Reported,
from the restart: seconds until 50/90/99% of the phones heartbeated again (the database's
`latest_telemetry_at`), requests/s at the peak and 5xx answers per second (the replicas'
`phalanx_http_requests_total`, read every second), the replicas' peak RSS and threads
(/proc), and the sims' errors by kind. Targets (issue 18): 99% back within 60 s, no 5xx after
the first 10 s, threads bounded (not one per phone).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
import psycopg

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from domain.store.db import libpq_url, upgrade  # noqa: E402
from tests.support.server import free_port  # noqa: E402

ADMIN = "phx-adm-storm-" + uuid.uuid4().hex


def proc_status(pid: int) -> tuple[int, int]:
    """(RSS bytes, threads) of a process and its children (uvicorn's workers)."""
    rss = threads = 0
    for p in [pid, *children(pid)]:
        try:
            text = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
        rss += int(fields.get("VmRSS", "0 kB").split()[0]) * 1024
        threads += int(fields.get("Threads", "0"))
    return rss, threads


def children(pid: int) -> list[int]:
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return []
    return [int(k) for k in kids]


def request_counts(url: str) -> tuple[int, int]:
    """(all requests, 5xx answers) so far, from the replica's own metrics."""
    text = httpx.get(f"{url}/metrics", timeout=5).text
    total = errors = 0
    for line in text.splitlines():
        if line.startswith("phalanx_http_requests_total{"):
            value = float(line.rsplit(" ", 1)[1])
            total += int(value)
            if 'status="5' in line:
                errors += int(value)
    return total, errors


class Replica:
    def __init__(self, env: dict[str, str], root: Path) -> None:
        self.env, self.root = env, root
        self.port = free_port()
        self.bulk = free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        log = (self.root / f"server-{self.port}.log").open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "phalanx.cli.main", "server", "--port", str(self.port),
             "--bulk-port", str(self.bulk)], cwd=REPO, env=self.env, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True)

    def ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def kill(self) -> None:
        if self.process is not None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def wait(what: str, check: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.5)


def heartbeated_since(conn: psycopg.Connection, since: float) -> int:
    row = conn.execute("SELECT count(*) FROM devices WHERE latest_telemetry_at > "
                       "to_timestamp(%s) AT TIME ZONE 'UTC'", (since,)).fetchone()
    return int(row[0])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phones", type=int, default=10_000)
    parser.add_argument("--sims", type=int, default=4)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--interval", type=float, default=10.0)
    parser.add_argument("--settle", type=float, default=60.0, help="max seconds to enroll all")
    parser.add_argument("--after", type=float, default=120.0, help="seconds watched after")
    parser.add_argument("--pg-url", default=os.environ.get(
        "PHALANX_TEST_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"))
    parser.add_argument("--redis-url", default=os.environ.get(
        "PHALANX_TEST_REDIS_URL", "redis://127.0.0.1:6379/13"))
    args = parser.parse_args()

    db = f"storm_{uuid.uuid4().hex[:8]}"
    admin = psycopg.connect(libpq_url(args.pg_url), autocommit=True)
    admin.execute(f'CREATE DATABASE "{db}"')
    db_url = args.pg_url.rpartition("/")[0] + "/" + db
    upgrade(db_url)
    import redis

    redis.Redis.from_url(args.redis_url).flushdb()
    root = Path(tempfile.mkdtemp(prefix="phalanx-storm-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")}
    env.update(PHALANX_DATABASE_URL=db_url, PHALANX_REDIS_URL=args.redis_url,
               PHALANX_ADMIN_TOKEN=ADMIN, PHALANX_DATA_DIR=str(root),
               PHALANX_HEARTBEAT_INTERVAL_S=str(args.interval),
               PHALANX_LEASE_GRACE_S=str(4 * args.interval + 60), PYTHONUNBUFFERED="1")
    replicas = [Replica(env, root) for _ in range(args.replicas)]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for r in replicas:
            r.start()
        for r in replicas:
            wait("a replica", r.ready, 60)
        procs.append(subprocess.Popen([sys.executable, "-m", "phalanx.cli.main", "worker",
                                       "--beat"], cwd=REPO, env=env,
                                      stdout=(root / "worker.log").open("ab"),
                                      stderr=subprocess.STDOUT))
        token = httpx.post(f"{replicas[0].url}/v1/enrollment-tokens", json={},
                           headers={"Authorization": f"Bearer {ADMIN}"}).json()["token"]
        per_sim = args.phones // args.sims
        for i in range(args.sims):
            replica = replicas[i % len(replicas)]
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "phalanx.cli.main", "sim", "--phones", str(per_sim),
                 "--server", replica.url, "--enroll-token", token, "--interval",
                 str(args.interval), "--duration", str(args.settle + args.after + 120),
                 "--no-cleanup", "-o", "json", "--concurrency", "256"],
                cwd=REPO, env=env, stdout=(root / f"sim-{i}.json").open("wb"),
                stderr=(root / f"sim-{i}.log").open("wb")))
        total = per_sim * args.sims
        conn = psycopg.connect(libpq_url(db_url), autocommit=True)
        began = time.time()
        wait("every phone to heartbeat", lambda: heartbeated_since(conn, began - 1) >= total,
             args.settle + 120)
        time.sleep(args.interval)  # steady state: every phone on its own beat
        print(f"{total} phones heartbeating (enrolled in {time.time() - began:.0f} s); "
              "restarting every replica at once", flush=True)
        restart = time.time()
        for r in replicas:
            r.kill()
        for r in replicas:
            r.start()
        marks: dict[int, float] = {}
        peak_rate = peak_rss = peak_threads = 0
        errors_after_10s = 0
        first_5xx: list[float] = []
        last = {r.port: (0, 0) for r in replicas}
        last_t = time.monotonic()
        deadline = restart + args.after
        while time.time() < deadline:
            time.sleep(1.0)
            now = time.monotonic()
            counts = {}
            for r in replicas:
                try:
                    counts[r.port] = request_counts(r.url)
                except httpx.HTTPError:
                    counts[r.port] = last[r.port]
                rss, threads = proc_status(r.process.pid) if r.process else (0, 0)
                peak_rss, peak_threads = max(peak_rss, rss), max(peak_threads, threads)
            rate = sum(max(0, counts[p][0] - last[p][0]) for p in counts) / (now - last_t)
            fives = sum(max(0, counts[p][1] - last[p][1]) for p in counts)
            since = time.time() - restart
            if fives:
                first_5xx.append(since)
                if since > 10:
                    errors_after_10s += fives
            peak_rate = max(peak_rate, int(rate))
            last, last_t = counts, now
            back = heartbeated_since(conn, restart)
            for pct in (50, 90, 99):
                if pct not in marks and back >= total * pct / 100:
                    marks[pct] = since
            print(f"  t+{since:5.1f} s: {back:6d}/{total} back, {rate:7.0f} req/s, 5xx {fives}",
                  flush=True)
            if 99 in marks and since > marks[99] + 10:
                break
        result = {"phones": total, "replicas": args.replicas, "sims": args.sims,
                  "back_s": marks, "peak_requests_per_s": peak_rate,
                  "peak_replica_rss_mb": round(peak_rss / 2**20), "peak_replica_threads": peak_threads,
                  "5xx_after_10s": errors_after_10s,
                  "5xx_seconds": [round(s, 1) for s in first_5xx[:20]]}
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)  # the sims stop and print their reports
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        for r in replicas:
            r.kill()
        admin.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
    errors: dict[str, int] = {}
    for i in range(args.sims):
        try:
            report = json.loads((root / f"sim-{i}.json").read_text() or "{}")
        except ValueError:
            continue
        for kind, n in (report.get("errors_by_kind") or {}).items():
            errors[kind] = errors.get(kind, 0) + n
    result["sim_errors_by_kind"] = dict(sorted(errors.items(), key=lambda kv: -kv[1])[:12])
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
