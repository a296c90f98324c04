"""100,000 phones on one control plane (issue 45 item 5): steady heartbeats, every replica killed
and restarted, and a 138-phone gang placed in the 100,000-device fleet.

    source scripts/services.sh && ensure_services
    .venv/bin/python bench/fleet_100k.py [--phones 100000] [--interval 60] [--steady 300]
                                         [--replicas 1] [--workers 2] [--connections 1024]

1. A fresh Postgres database and Redis database 9; `--replicas` `phalanx server --workers N`
   (Postgres + Redis, as production runs it) and one `phalanx worker --beat`; heartbeat
   interval `--interval` s, lease grace 2.5 intervals.
2. One `phalanx sim --mode swarm` process (the whole fleet, one core) enrolls `--phones` phones
   over `--connections` shared keep-alive connections, and they heartbeat. Its per-second JSON
   lines (stderr) carry each window's heartbeat latency histogram and answers by status.
3. Steady: the first round of heartbeats (until 99% of the phones have beaten, at most
   `--settle-max` s) and one interval more, then `--steady` s measured:
   heartbeats/s, p50/p99 (the histograms merged over the phase), errors by status, the phones
   the database saw heartbeat within 1.5 intervals at the end.
4. Storm: every replica's process group SIGKILLed, started again on the same ports at once.
   Each second: phones whose `latest_telemetry_at` is after the kill (the database), 5xx and
   transport errors the phones saw (the swarm's windows), the replicas' RSS and threads.
   Until 99% are back and 10 s more, or `--after` s.
5. Placement: the worker stopped; a pending job for a 138-phone gang (552 shards) submitted;
   the placement pass run as reconcile runs it (`placement_pass(ctx, session, now)` in a
   transaction, here rolled back), `--repeats` times, with its parts timed apart: reading
   the device views, and the pure policy (`place_gang`) on them.

Every phase prints the load average (this 2-core machine is shared), and the CPU each part
used (server, worker, Postgres, Redis, the swarm) from /proc. The result is one JSON document
(stdout, and `--out`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import psycopg

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.placement_100k import GANG_SPEC, time_placement  # noqa: E402
from bench.reconnect_storm import children, proc_status  # noqa: E402
from domain.store.db import libpq_url, upgrade  # noqa: E402
from phalanx.sim.swarm_stats import LatencyHistogram  # noqa: E402
from tests.support.server import free_port  # noqa: E402

ADMIN = "phx-adm-fleet-" + uuid.uuid4().hex
TICKS = os.sysconf("SC_CLK_TCK")


def log(msg: str) -> None:
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"[{time.strftime('%H:%M:%S')} load {load}] {msg}", file=sys.stderr, flush=True)


def tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children(p))
    return out


def cpu_ticks(pids: list[int]) -> int:
    total = 0
    for p in pids:
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total


def pids_named(name: str) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() == name:
                    out.append(int(entry.name))
            except OSError:
                continue
    return out


class CpuMeter:
    """CPU seconds used by each part between `start` and `stop` (the parts' processes as they
    are at each reading: a replica restarted is counted from its new processes)."""

    def __init__(self, parts: dict[str, Any]) -> None:
        self.parts = parts  # name -> callable returning pids
        self.began: dict[str, int] = {}
        self.t0 = 0.0

    def read(self) -> dict[str, int]:
        return {name: cpu_ticks(pids()) for name, pids in self.parts.items()}

    def start(self) -> None:
        self.began, self.t0 = self.read(), time.monotonic()

    def shares(self) -> dict[str, float]:
        """Cores used by each part since `start` (a replica's restart resets its count)."""
        now, span = self.read(), max(1e-9, time.monotonic() - self.t0)
        return {name: round(max(0, now[name] - self.began.get(name, 0)) / TICKS / span, 3)
                for name in now}


class Replica:
    def __init__(self, env: dict[str, str], root: Path, workers: int) -> None:
        self.env, self.root, self.workers = env, root, workers
        self.port, self.bulk = free_port(), free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        out = (self.root / f"server-{self.port}.log").open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "phalanx.cli.main", "server", "--port", str(self.port),
             "--bulk-port", str(self.bulk), "--workers", str(self.workers)], cwd=REPO,
            env=self.env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def pids(self) -> list[int]:
        return tree(self.process.pid) if self.process and self.process.poll() is None else []

    def kill(self) -> None:
        if self.process is not None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def wait_until(what: str, check: Any, timeout: float, every: float = 0.5) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(every)


class SwarmWatch:
    """The swarm's per-second JSON lines, read from its stderr on a thread."""

    def __init__(self, process: subprocess.Popen[bytes], raw_log: Path) -> None:
        self.process, self.lines, self.raw = process, [], raw_log.open("a")
        self.lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stderr is not None
        for raw in self.process.stderr:
            text = raw.decode("utf-8", "replace").strip()
            self.raw.write(text + "\n")
            try:
                line = json.loads(text)
            except ValueError:
                continue
            if isinstance(line, dict) and "t" in line:
                with self.lock:
                    self.lines.append(line)

    def last(self) -> dict[str, Any]:
        with self.lock:
            return self.lines[-1] if self.lines else {}

    def between(self, start_wall: float, end_wall: float) -> list[dict[str, Any]]:
        with self.lock:
            return [x for x in self.lines if start_wall < x["wall"] <= end_wall]


def summarize(windows: list[dict[str, Any]]) -> dict[str, Any]:
    """Heartbeats, their latency (histograms merged) and the answers by status over windows."""
    hist = LatencyHistogram()
    statuses: dict[str, Counter[str]] = {}
    for w in windows:
        hist.merge(LatencyHistogram.from_sparse(w.get("heartbeat_hist") or {},
                                                (w.get("heartbeat_ms") or {}).get("max", 0) / 1000))
        for ep, counts in w["statuses"].items():
            statuses.setdefault(ep, Counter()).update(counts)
    span = sum(w["span_s"] for w in windows) or 1e-9
    hb = statuses.get("heartbeat", Counter())
    return {"seconds": round(span, 1), "heartbeats": sum(hb.values()),
            "heartbeats_per_s": round(sum(hb.values()) / span, 1),
            "heartbeat_ms": hist.summary_ms(),
            "statuses": {ep: dict(c) for ep, c in statuses.items()},
            "swarm_cpu": round(sum(w["cpu"] * w["span_s"] for w in windows) / span, 3),
            "swarm_lag_p99_ms_max": max((w["lag_p99_ms"] for w in windows), default=0)}


def count_since(conn: psycopg.Connection, since_wall: float) -> int:
    row = conn.execute("SELECT count(*) FROM devices WHERE latest_telemetry_at > "
                       "to_timestamp(%s) AT TIME ZONE 'UTC'", (since_wall,)).fetchone()
    return int(row[0])


def states(conn: psycopg.Connection) -> dict[str, int]:
    return dict(conn.execute("SELECT state, count(*) FROM devices GROUP BY state").fetchall())


def replicas_status(replicas: list[Replica]) -> tuple[int, int]:
    rss = threads = 0
    for r in replicas:
        if r.process is not None and r.process.poll() is None:
            a, b = proc_status(r.process.pid)
            rss, threads = rss + a, threads + b
    return rss, threads


def phase_enroll(args: argparse.Namespace, watch: SwarmWatch, cpu: CpuMeter) -> dict[str, Any]:
    began, load0 = time.monotonic(), os.getloadavg()
    cpu.start()
    last_print = 0.0
    while watch.last().get("enrolled", 0) < args.phones:
        if watch.process.poll() is not None:
            raise SystemExit(f"the swarm exited ({watch.process.returncode}); see its log")
        time.sleep(1)
        if time.monotonic() - last_print >= 15:
            last_print = time.monotonic()
            line = watch.last()
            done = line.get("enrolled", 0)
            rate = done / max(1e-9, time.monotonic() - began)
            log(f"enrolled {done}/{args.phones} ({rate:.0f}/s, ETA "
                f"{(args.phones - done) / max(rate, 1e-9):.0f} s); heartbeats "
                f"{line.get('heartbeats_per_s', 0)}/s p99 "
                f"{(line.get('heartbeat_ms') or {}).get('p99', 0)} ms; cores {cpu.shares()}")
        if time.monotonic() - began > args.enroll_timeout:
            raise SystemExit(f"enrollment took over {args.enroll_timeout} s")
    took = time.monotonic() - began
    return {"phones": args.phones, "seconds": round(took, 1),
            "per_s": round(args.phones / took, 1), "cores": cpu.shares(),
            "load_before": load0, "load_after": os.getloadavg()}


def phase_steady(args: argparse.Namespace, watch: SwarmWatch, cpu: CpuMeter,
                 conn: psycopg.Connection, replicas: list[Replica]) -> dict[str, Any]:
    # the first round is not the steady state: every phone's first heartbeat brings its
    # capabilities and brings it back from NotReady (the fleet enrolled first); settle until
    # 99% of the phones have beaten, then one interval more
    settle_began = time.time()
    log(f"settling: until 99% have heartbeated (at most {args.settle_max:g} s), then one "
        f"interval ({args.interval:g} s)")
    while (count_since(conn, settle_began - 1) < 0.99 * args.phones
           and time.time() < settle_began + args.settle_max):
        time.sleep(5)
    first_round = time.time() - settle_began
    log(f"first round: {count_since(conn, settle_began - 1)} phones in {first_round:.0f} s")
    time.sleep(args.interval)
    load0, began = os.getloadavg(), time.time()
    cpu.start()
    peak_rss = peak_threads = 0
    loads = []
    log(f"steady phase: {args.steady:g} s measured")
    while time.time() < began + args.steady:
        time.sleep(5)
        rss, threads = replicas_status(replicas)
        peak_rss, peak_threads = max(peak_rss, rss), max(peak_threads, threads)
        loads.append(os.getloadavg()[0])
        if len(loads) % 6 == 0:
            s = summarize(watch.between(time.time() - 30, time.time()))
            log(f"  last 30 s: {s['heartbeats_per_s']}/s {s['heartbeat_ms']} {s['statuses']}")
    end = time.time()
    fresh = count_since(conn, end - 1.5 * args.interval)
    out = summarize(watch.between(began, end))
    out.update(first_round_s=round(first_round, 1), cores=cpu.shares(), load_before=load0, load_after=os.getloadavg(),
               load_1min_range=[min(loads, default=0), max(loads, default=0)],
               fresh_within_1_5_intervals=fresh, device_states=states(conn),
               replica_peak_rss_mb=round(peak_rss / 2**20), replica_peak_threads=peak_threads)
    return out


def phase_storm(args: argparse.Namespace, watch: SwarmWatch, cpu: CpuMeter,
                conn: psycopg.Connection, replicas: list[Replica]) -> dict[str, Any]:
    load0 = os.getloadavg()
    log("killing every replica (SIGKILL to each process group) and starting them again")
    restart = time.time()
    for r in replicas:
        r.kill()
    for r in replicas:
        r.start()
    cpu.start()
    marks: dict[str, float] = {}
    curve: list[tuple[float, int]] = []
    peak_rss = peak_threads = 0
    up_at: float | None = None
    while time.time() < restart + args.after:
        time.sleep(1.0)
        since = time.time() - restart
        if up_at is None and all(r.ready() for r in replicas):
            up_at = since
        rss, threads = replicas_status(replicas)
        peak_rss, peak_threads = max(peak_rss, rss), max(peak_threads, threads)
        back = count_since(conn, restart)
        curve.append((round(since, 1), back))
        for pct in (50, 90, 99, 100):
            if str(pct) not in marks and back >= args.phones * pct / 100:
                marks[str(pct)] = round(since, 1)
        if int(since) % 5 == 0:
            line = watch.last()
            log(f"  t+{since:5.1f} s: {back:6d}/{args.phones} back; swarm: "
                f"{line.get('heartbeats_per_s')}/s, {line.get('statuses', {}).get('heartbeat')}")
        if "99" in marks and since > marks["99"] + 10:
            break
    end = time.time()
    time.sleep(1.5)  # the swarm's last window
    windows = watch.between(restart, end)
    errors_after: Counter[str] = Counter()
    first_10: Counter[str] = Counter()
    per_second: list[dict[str, Any]] = []
    for w in windows:
        t = w["wall"] - restart
        bad = {s: n for ep, c in w["statuses"].items() for s, n in c.items()
               if not s.startswith("2")}
        (errors_after if t - w["span_s"] > 10 else first_10).update(bad)
        per_second.append({"t": round(t, 1), "heartbeats_per_s": w["heartbeats_per_s"],
                           "bad": bad, "p99_ms": (w.get("heartbeat_ms") or {}).get("p99")})
    fives_after = sum(n for s, n in errors_after.items() if s.startswith("5"))
    return {"back_s": marks, "replicas_answering_s": up_at, "curve": curve[::5],
            "errors_first_10s": dict(first_10), "errors_after_10s": dict(errors_after),
            "5xx_after_10s": fives_after, "summary": summarize(windows),
            "replica_peak_rss_mb": round(peak_rss / 2**20), "replica_peak_threads": peak_threads,
            "cores": cpu.shares(), "load_before": load0, "load_after": os.getloadavg(),
            "per_second": per_second[:40]}


def phase_placement(args: argparse.Namespace, env: dict[str, str], url: str) -> dict[str, Any]:
    """The gang submitted to the live server (no worker runs now: it stays pending), then the
    placement pass timed as reconcile runs it on this database (bench/placement_100k.py)."""
    os.environ.update({k: v for k, v in env.items() if k.startswith("PHALANX_")})
    from domain.settings import Settings

    resp = httpx.post(f"{url}/v1/jobs", json=GANG_SPEC, timeout=120,
                      headers={"Authorization": f"Bearer {ADMIN}"})
    if resp.status_code != 201:
        raise SystemExit(f"job refused: {resp.status_code} {resp.text[:400]}")
    return time_placement(Settings(), resp.json()["id"], args.repeats)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phones", type=int, default=100_000)
    parser.add_argument("--interval", type=float, default=60.0)
    parser.add_argument("--steady", type=float, default=300.0, help="seconds measured steady")
    parser.add_argument("--after", type=float, default=240.0, help="most seconds watched after "
                        "the restart")
    parser.add_argument("--replicas", type=int, default=1)
    parser.add_argument("--workers", type=int, default=2, help="uvicorn workers per replica")
    parser.add_argument("--connections", type=int, default=1024, help="the swarm's connections "
                        "(enough that the swarm never queues a heartbeat behind a slow server)")
    parser.add_argument("--repeats", type=int, default=5, help="placement passes timed")
    parser.add_argument("--enroll-timeout", type=float, default=3600.0)
    parser.add_argument("--settle-max", type=float, default=600.0, help="most seconds for the "
                        "first round of heartbeats before the steady phase")
    parser.add_argument("--skip", default="", help="phases to skip: storm,placement")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--pg-url", default=os.environ.get(
        "PHALANX_TEST_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"))
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/9")
    args = parser.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    # SIGTERM (and SIGINT, ignored in a background job) end the run through the cleanup below
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: sys.exit("stopped by a signal"))

    db = f"fleet_{uuid.uuid4().hex[:8]}"
    admin = psycopg.connect(libpq_url(args.pg_url), autocommit=True)
    admin.execute(f'CREATE DATABASE "{db}"')
    db_url = args.pg_url.rpartition("/")[0] + "/" + db
    upgrade(db_url)
    import redis

    redis.Redis.from_url(args.redis_url).flushdb()
    root = Path(tempfile.mkdtemp(prefix="phalanx-fleet-"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")}
    env.update(PHALANX_DATABASE_URL=db_url, PHALANX_REDIS_URL=args.redis_url,
               PHALANX_ADMIN_TOKEN=ADMIN, PHALANX_DATA_DIR=str(root),
               PHALANX_HEARTBEAT_INTERVAL_S=f"{args.interval:g}",
               PHALANX_LEASE_GRACE_S=f"{2.5 * args.interval:g}", PYTHONUNBUFFERED="1")
    replicas = [Replica(env, root, args.workers) for _ in range(args.replicas)]
    worker: subprocess.Popen[bytes] | None = None
    swarm: subprocess.Popen[bytes] | None = None
    result: dict[str, Any] = {"phones": args.phones, "interval_s": args.interval,
                              "replicas": args.replicas, "workers": args.workers,
                              "connections": args.connections, "cpus": os.cpu_count(),
                              "started": dt.datetime.now().isoformat(timespec="seconds"),
                              "logs": str(root)}
    try:
        for r in replicas:
            r.start()
        for r in replicas:
            wait_until("a replica", r.ready, 120)
        worker = subprocess.Popen([sys.executable, "-m", "phalanx.cli.main", "worker", "--beat"],
                                  cwd=REPO, env=env, stdout=(root / "worker.log").open("ab"),
                                  stderr=subprocess.STDOUT, start_new_session=True)
        swarm = subprocess.Popen(
            [sys.executable, "-m", "phalanx.cli.main", "sim", "--mode", "swarm", "--phones",
             str(args.phones), "--server", replicas[0].url, "--token", ADMIN, "--duration",
             "86400", "--no-cleanup", "-o", "json", "--concurrency", str(args.connections)],
            cwd=REPO, env=env, stdout=(root / "swarm.json").open("wb"), stderr=subprocess.PIPE)
        watch = SwarmWatch(swarm, root / "swarm.log")
        parts = {"server": lambda: [p for r in replicas for p in r.pids()],
                 "worker": lambda: tree(worker.pid) if worker else [],
                 "postgres": lambda: pids_named("postgres"),
                 "redis": lambda: pids_named("redis-server"),
                 "swarm": lambda: [swarm.pid] if swarm else []}
        cpu = CpuMeter(parts)
        conn = psycopg.connect(libpq_url(db_url), autocommit=True)
        log(f"enrolling {args.phones} phones (logs in {root})")
        result["enroll"] = phase_enroll(args, watch, cpu)
        log(f"enrolled: {result['enroll']}")
        save(args.out, result)
        result["steady"] = phase_steady(args, watch, cpu, conn, replicas)
        log(f"steady: {json.dumps(result['steady'])}")
        save(args.out, result)
        if "storm" not in skip:
            result["storm"] = phase_storm(args, watch, cpu, conn, replicas)
            log(f"storm: {json.dumps(result['storm'])}")
            save(args.out, result)
        if "placement" not in skip:
            # the placement timing on a machine without the swarm and the worker (a warm
            # shutdown would wait for a reconcile pass: minutes at 100,000 devices)
            swarm.send_signal(signal.SIGTERM)
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
            worker = None
            swarm.wait(timeout=120)
            result["placement"] = phase_placement(args, env, replicas[0].url)
            log(f"placement: {result['placement']}")
            save(args.out, result)
    finally:
        if swarm is not None and swarm.poll() is None:
            swarm.send_signal(signal.SIGTERM)
            try:
                swarm.wait(timeout=60)
            except subprocess.TimeoutExpired:
                swarm.kill()
        if worker is not None and worker.poll() is None:
            os.killpg(worker.pid, signal.SIGKILL)
            worker.wait()
        for r in replicas:
            if r.process is not None and r.process.poll() is None:
                r.kill()
        admin.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
    try:
        report = json.loads((root / "swarm.json").read_text() or "{}")
        result["swarm_report"] = {k: report.get(k) for k in (
            "requests", "elapsed_s", "errors_by_kind", "cpu_share", "cpu_us_per_request",
            "lag_ms", "endpoints")}
    except ValueError:
        pass
    save(args.out, result)
    print(json.dumps(result, indent=1))


def save(out: Path | None, result: dict[str, Any]) -> None:
    """The result so far (each phase's as it ends: a run cut short keeps what it measured)."""
    if out is not None:
        out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
