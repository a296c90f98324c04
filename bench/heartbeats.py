"""Heartbeat throughput of `phalanx server` on Postgres, against /healthz of the same server.

    .venv/bin/python bench/heartbeats.py [--devices 1000] [--connections 32] [--duration 10]
                                         [--rounds 3]

Creates a fresh Postgres database, starts `phalanx server --workers 2` (Postgres + Redis, so not
embedded), registers N devices through the API, then drives the server with `wrk` (a Lua script
rotates the device tokens; each heartbeat carries 3 samples): first /healthz, then heartbeats,
same connections and duration, after a short unmeasured warm-up, alternating for --rounds
rounds. Prints each round's heartbeats/s, p50/p99 latency, /healthz rate and ratio, the median
round, and checks that every 2xx heartbeat's samples are in the database.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psycopg

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from domain.store.db import libpq_url  # noqa: E402
from tests.support.server import start_server  # noqa: E402

ADMIN = "phx-adm-bench-" + uuid.uuid4().hex
LUA_COMMON = r"""
local results = {}
done = function(summary, latency, requests)
  local non2xx = summary.errors.status
  io.write(string.format('{"requests": %d, "seconds": %f, "non2xx": %d, "socket_errors": %d, '
    .. '"p50_ms": %f, "p90_ms": %f, "p99_ms": %f, "max_ms": %f}\n',
    summary.requests, summary.duration / 1e6, non2xx,
    summary.errors.connect + summary.errors.read + summary.errors.write + summary.errors.timeout,
    latency:percentile(50) / 1000, latency:percentile(90) / 1000,
    latency:percentile(99) / 1000, latency.max / 1000))
end
"""
LUA_HEARTBEAT = r"""
local devices = {}
for line in io.lines(os.getenv("BENCH_DEVICES")) do
  local id, token = line:match("([^ ]+) ([^ ]+)")
  devices[#devices + 1] = {id = id, token = token}
end
local counter = 0
local base = 0
setup = function(thread) thread:set("tid", thread.id or math.random(1000)) end
init = function(args) counter = math.random(#devices) - 1; base = os.time() end
request = function()
  counter = counter + 1
  local d = devices[(counter % #devices) + 1]
  local ts = base + counter * 0.001
  local s = '{"ts": %f, "battery_pct": 81.5, "charging": false, "battery_temp_c": 33.1, '
    .. '"cpu_temp_c": 41.2, "power_w": 2.9, "cpu_freq_mhz": 1785.6, "throttled": false, "busy": false}'
  local body = '{"telemetry": [' .. string.format(s, ts) .. ', ' .. string.format(s, ts + 0.0001)
    .. ', ' .. string.format(s, ts + 0.0002) .. '], "agent_version": "0.1.0"}'
  return wrk.format("POST", "/v1/devices/" .. d.id .. "/heartbeat",
    {["Authorization"] = "Bearer " .. d.token, ["Content-Type"] = "application/json"}, body)
end
"""


def fresh_database(admin_url: str) -> str:
    name = f"phalanx_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(libpq_url(admin_url), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return admin_url.rpartition("/")[0] + "/" + name


def drop_database(url: str) -> None:
    admin, name = url.rpartition("/")[0] + "/postgres", url.rpartition("/")[2]
    with psycopg.connect(libpq_url(admin), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def register_devices(base_url: str, n: int) -> list[tuple[str, str]]:
    headers = {"Authorization": f"Bearer {ADMIN}"}
    with httpx.Client(base_url=base_url, headers=headers, timeout=60) as client:
        token = client.post("/v1/enrollment-tokens", json={}).raise_for_status().json()["token"]

        def one(i: int) -> tuple[str, str]:
            body = {"enrollment_token": token, "name": f"bench-{i}", "labels": {"rack": "bench"}}
            got = client.post("/v1/devices/register", json=body).raise_for_status().json()
            return got["device_id"], got["device_token"]

        with ThreadPoolExecutor(max_workers=8) as pool:
            return list(pool.map(one, range(n)))


def run_wrk(url: str, script: Path, args: argparse.Namespace, env: dict[str, str],
            duration: int | None = None) -> dict:
    cmd = ["wrk", f"-t{args.threads}", f"-c{args.connections}", f"-d{duration or args.duration}s",
           "--timeout", "5s", "-s", str(script), url]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def process_cpu_sessions() -> list[tuple[int, int, float]]:
    """(pid, session id, user + system seconds so far) of every readable process (/proc)."""
    tick, found = os.sysconf("SC_CLK_TCK"), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state, ppid, pgrp, session, ...
        found.append((int(pid), int(fields[3]), (int(fields[11]) + int(fields[12])) / tick))
    return found


def cpu_seconds(server_pid: int, db_url: str) -> dict[str, float]:
    """CPU time so far (user + system) of this run's own processes only, which a noisy shared
    machine blurs less than rates: the server (uvicorn's parent and workers: its session), the
    Postgres backends connected to the bench's database (not WAL writer or checkpointer, which
    serve every database) and wrk (the children this script has reaped)."""
    database = db_url.rpartition("/")[2]
    with psycopg.connect(libpq_url(db_url), autocommit=True) as conn:
        backends = {pid for (pid,) in conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s AND pid <> pg_backend_pid()",
            (database,))}
    totals = {"server": 0.0, "postgres": 0.0}
    for pid, session, seconds in process_cpu_sessions():
        if session == server_pid:
            totals["server"] += seconds
        elif pid in backends:
            totals["postgres"] += seconds
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    totals["wrk"] = children.ru_utime + children.ru_stime
    return totals


def cpu_per_request(before: dict[str, float], after: dict[str, float], requests: int) -> str:
    """µs of CPU per request of the server, its Postgres backends and wrk."""
    return " ".join(f"{group} {(after[group] - before[group]) / requests * 1e6:.0f}"
                    for group in ("server", "postgres", "wrk"))


def count_samples(db_url: str) -> int:
    with psycopg.connect(libpq_url(db_url)) as conn:
        return conn.execute("SELECT count(*) FROM telemetry_samples").fetchone()[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=1000)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--duration", type=int, default=10)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3, help="seconds of unmeasured heartbeats")
    parser.add_argument("--rounds", type=int, default=3,
                        help="alternating /healthz + heartbeat rounds; the median ratio counts "
                             "(a shared machine's load drifts within a run)")
    parser.add_argument("--database", default=os.environ.get(
        "PHALANX_TEST_DATABASE_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"))
    parser.add_argument("--redis", default=os.environ.get(
        "PHALANX_TEST_REDIS_URL", "redis://127.0.0.1:6379/14"))
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("wrk is not installed (Debian: apt-get install -y wrk)")
    db_url = fresh_database(args.database)
    work = Path(tempfile.mkdtemp(prefix="phalanx-bench-"))
    server = start_server(database_url=db_url, data_dir=work / "data", admin_token=ADMIN,
                          redis_url=args.redis, args=["--workers", str(args.workers)],
                          # the write path's throughput: every device beats back to back, far
                          # past the per-device rate a fleet is held to
                          extra_env={"PHALANX_HEARTBEAT_MAX_PER_MINUTE": "1e9",
                                     "PHALANX_HEARTBEAT_BURST": "1000000000"})
    print(f"server pid {server.process.pid} at {server.url}", file=sys.stderr, flush=True)  # for profilers
    try:
        devices = register_devices(server.url, args.devices)
        (work / "devices.txt").write_text("".join(f"{i} {t}\n" for i, t in devices))
        (work / "healthz.lua").write_text(LUA_COMMON)
        (work / "heartbeat.lua").write_text(LUA_HEARTBEAT + LUA_COMMON)
        env = {**os.environ, "BENCH_DEVICES": str(work / "devices.txt")}
        # warm-up (not measured): pools connected, statements prepared, and every token seen
        # by every worker (a token's first heartbeat on a worker is a database lookup in a
        # thread, ~1 ms of Python: on a loaded machine a 3 s warm-up covered a fraction of the
        # fleet and the rounds measured lookups, not the steady state of a fleet)
        warmed = 0
        for _ in range(10):
            warmed += run_wrk(server.url, work / "heartbeat.lua", args, env,
                              duration=args.warmup)["requests"]
            if warmed >= 4 * args.workers * args.devices:
                break
        rounds = []
        before = count_samples(db_url)
        for _ in range(args.rounds):
            cpu0 = cpu_seconds(server.process.pid, db_url)
            healthz = run_wrk(f"{server.url}/healthz", work / "healthz.lua", args, env)
            cpu1 = cpu_seconds(server.process.pid, db_url)
            beats = run_wrk(server.url, work / "heartbeat.lua", args, env)
            cpu2 = cpu_seconds(server.process.pid, db_url)
            healthz["cpu"] = cpu_per_request(cpu0, cpu1, healthz["requests"])
            beats["cpu"] = cpu_per_request(cpu1, cpu2, beats["requests"])
            rounds.append((healthz, beats))
        stored = count_samples(db_url) - before
    finally:
        server.stop()
    drop_database(db_url)
    shutil.rmtree(work, ignore_errors=True)
    print(f"devices={args.devices} connections={args.connections} threads={args.threads} "
          f"duration={args.duration}s workers={args.workers} rounds={args.rounds}")
    ratios, accepted = [], 0
    for i, (healthz, beats) in enumerate(rounds, 1):
        ok = beats["requests"] - beats["non2xx"]
        accepted += ok
        hb_rate, hz_rate = ok / beats["seconds"], healthz["requests"] / healthz["seconds"]
        ratios.append((hb_rate / hz_rate, hb_rate, beats, hz_rate, healthz))
        print(f"round {i}: /healthz {hz_rate:6.0f} req/s p99 {healthz['p99_ms']:5.1f} ms | "
              f"heartbeat {hb_rate:6.0f} req/s p50 {beats['p50_ms']:5.1f} ms "
              f"p99 {beats['p99_ms']:5.1f} ms (non-2xx {beats['non2xx']}, socket errors "
              f"{beats['socket_errors']}) | ratio {hb_rate / hz_rate:.2f}")
        print(f"         CPU µs per request: /healthz {healthz['cpu']} | heartbeat {beats['cpu']}")
    ratio, hb_rate, beats, hz_rate, healthz = sorted(ratios, key=lambda r: r[0])[len(ratios) // 2]
    print(f"median round: /healthz {hz_rate:.0f} req/s, heartbeat {hb_rate:.0f} req/s "
          f"(3 samples each) p50 {beats['p50_ms']:.1f} ms p99 {beats['p99_ms']:.1f} ms")
    print(f"ratio heartbeat/healthz: {ratio:.2f} (median of {len(ratios)} rounds)")
    print(f"samples stored: {stored} for {accepted} accepted heartbeats "
          f"({'none lost' if stored >= 3 * accepted else 'LOST SAMPLES'})")

if __name__ == "__main__":
    main()
