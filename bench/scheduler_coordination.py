"""Per-step coordination overhead of Phalanx vs a gloo allreduce of the same vector.

    env -u OPENBLAS_CORETYPE .venv/bin/python bench/scheduler_coordination.py \
        [--agents 4,8,16,64] [--modes embedded,redis] [--steps 5] [--gloo-max 16]

Simulated agents (threads in a few processes) talk to a real `phalanx server` over HTTP: long
poll for work, download the step's weights, upload a precomputed result for their shard (a
mobilenet_v1-sized vector, 3,217,226 float32, zeros; `--arch resnet50`: 23.5 M, the heavy
case). One shard per agent, so every agent
moves one full vector per step as in an allreduce. The agents' only local work is encoding
the upload; coordination = step wall time (the server's step_seconds, commit to commit) minus
the slowest agent's encode. `redis` runs the server on Redis with a separate `phalanx worker`.
Before and after, in the same run, torch.distributed gloo allreduces the same vector across
the same number of local processes. Reported: Phalanx coordination / the mean of gloo's two.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.proc_cpu import process_cpu, process_faults, process_peak_rss  # noqa: E402

ADMIN = "phx-admin-bench-" + "0" * 24
DATASET = "synthetic:3x32x32:10:65536"
N_PARAMS = 3_217_226  # mobilenet_v1 (width 1, 10 classes)


def n_params_of(arch: str) -> int:
    from engine.jobinfo import job_info

    return job_info("b", {"name": "b", "model": {"arch": arch}, "dataset": DATASET},
                    None).model.n_params


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(root: Path, db_url: str, redis_url: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")}
    env.update(PHALANX_DATABASE_URL=db_url, PHALANX_DATA_DIR=str(root), PHALANX_ADMIN_TOKEN=ADMIN,
               PHALANX_LEASE_GRACE_S="3600", PHALANX_RECONCILE_INTERVAL_S="1",
               PHALANX_SCHED_STRAGGLER_FLOOR_S="600", PYTHONUNBUFFERED="1",
               PHALANX_MAX_UPLOAD_BYTES=str(256 * 1024 * 1024))
    if redis_url:
        env["PHALANX_REDIS_URL"] = redis_url
    return env


class Services:
    def __init__(self, root: Path, mode: str, pg_url: str | None, redis_url: str | None,
                 workers: int = 1) -> None:
        self.root, self.mode, self.workers = root, mode, workers
        self.procs: list[subprocess.Popen[bytes]] = []
        self.worker_procs: list[subprocess.Popen[bytes]] = []
        if mode == "redis":
            import redis

            assert redis_url, "--redis-url (or PHALANX_TEST_REDIS_URL) is needed for mode redis"
            redis.Redis.from_url(redis_url).flushdb()
        from domain.store.db import upgrade

        self.db_url = pg_url if (mode == "redis" and pg_url) else f"sqlite:///{root / 'db.sqlite'}"
        upgrade(self.db_url)
        self.env = base_env(root, self.db_url, redis_url if mode == "redis" else None)
        # the bulk port is chosen free too: the default (port + 1) can be taken by another
        # process, and then the server serves the data plane on the API port only, which made
        # one run in four about twice as slow
        self.port = free_port()
        self.bulk_port = next(p for p in iter(free_port, None) if p != self.port)
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = [sys.executable, "-m", "phalanx.cli.main", "server", "--port", str(self.port),
               "--bulk-port", str(self.bulk_port),
               "--workers", os.environ.get("BENCH_API_WORKERS", "1")]
        self._spawn(cmd, "server.log")
        if self.mode == "redis":
            for i in range(self.workers):  # one beat; the others work only
                self.worker_procs.append(self._spawn(
                    [sys.executable, "-m", "phalanx.cli.main", "worker",
                     *(["--beat"] if i == 0 else []),
                     "--loglevel", os.environ.get("BENCH_WORKER_LOGLEVEL", "WARNING")],
                    f"worker-{i}.log"))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    log = (self.root / "server.log").read_text(errors="replace")
                    assert "not available" not in log, "bulk port taken: " + log[-2000:]
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        raise RuntimeError((self.root / "server.log").read_text()[-3000:])

    def _spawn(self, cmd: list[str], log: str) -> subprocess.Popen[bytes]:
        with open(self.root / log, "ab") as fh:
            proc = subprocess.Popen(cmd, cwd=REPO, env=self.env, stdout=fh,
                                    stderr=subprocess.STDOUT)
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


def enroll(url: str, n: int) -> list[tuple[str, str]]:
    admin = {"Authorization": f"Bearer {ADMIN}"}
    with httpx.Client(base_url=url, timeout=30) as c:
        token = c.post("/v1/enrollment-tokens", json={"max_uses": n}, headers=admin).json()["token"]
        out = []
        for i in range(n):
            r = c.post("/v1/devices/register", json={"enrollment_token": token, "name": f"sim-{i}"})
            r.raise_for_status()
            dev, secret = r.json()["device_id"], r.json()["device_token"]
            c.post(f"/v1/devices/{dev}/heartbeat", json={"telemetry": []},
                   headers={"Authorization": f"Bearer {secret}"}).raise_for_status()
            out.append((dev, secret))
        return out


def agent_thread(url: str, device: str, secret: str, stop: Any, log: Any,
                 pre_add: bool) -> None:
    from agent.client import Client, ClientError
    from agent.runtime.slices import SliceFetcher

    c = Client(url, secret, timeout_s=300)  # the phone's own HTTP client (stdlib)
    slices = SliceFetcher(c)  # the real agent's, for a sliced job (issue 21 items 2 and 4)
    while not stop.is_set():
        try:
            one_step(c, device, log, pre_add, slices)
        except ClientError:
            if stop.is_set():
                return  # the server is going away at the end of the run
            time.sleep(0.1)


_GRADS: dict[int, np.ndarray] = {}  # a zero gradient of each model size, made once


def one_step(c: Any, device: str, log: Any, pre_add: bool, slices: Any) -> None:
    """One step of a simulated phone: weights down, one zero result per shard it holds up
    (pre-added up the reduction tree, as the real agent does, when `pre_add` and the server
    takes partials; issue 21 item 1), counting the bytes it uploads."""
    from agent.client import Conflict
    from engine.step import ShardResult, pre_reduce
    from wire.messages import encode_results_parts

    a = c.work(device, 2)
    if a is None:
        return
    got_work = time.time()
    job, step = a.job_id, a.step
    slices.stop_ahead()
    try:
        if a.slices:  # one message a slice, side by side, those fetched ahead taken
            slices.whole(a, lambda call: call(a.bulk_url))
        else:
            c.weights(job, step, bulk_url=a.bulk_url)
    except Conflict:
        return
    got_weights = time.time()
    t0 = time.perf_counter()
    stats = np.zeros(a.n_stats, np.float32)
    m = a.spec["global_batch_size"] // a.spec["shards"]
    grad = _GRADS.get(a.n_params)
    if grad is None:  # not setdefault: its default (12.9 MB zeroed) would be made every step
        grad = _GRADS[a.n_params] = np.zeros(a.n_params, np.float32)
    results = [ShardResult(k, grad, 1.0, 0, m, stats) for k in a.shards]
    precision = a.spec.get("upload_precision", "float32")  # what the job uploads in
    if pre_add and a.pre_reduce and len(results) > 1:
        results = pre_reduce(results, a.spec["shards"], precision)
    body = encode_results_parts(job, step, results, precision)
    local = time.perf_counter() - t0
    upload_start = time.time()
    c.upload_gradients(job, step, body, bulk_url=a.bulk_url)
    if a.slices:
        slices.fetch_ahead(a)  # step + 1's slices, each once applied
    log.put((step, local, (got_work, got_weights, upload_start, time.time()),
             sum(len(part) for part in body)))


def agent_process(url: str, devices: list[tuple[str, str]], stop: Any, log: Any,
                  pre_add: bool) -> None:
    threads = [threading.Thread(target=agent_thread, args=(url, d, s, stop, log, pre_add),
                                daemon=True) for d, s in devices]
    for t in threads:
        t.start()
    while not stop.is_set():
        time.sleep(0.1)


def run_phalanx(root: Path, mode: str, n: int, steps: int, pg: str | None, rd: str | None,
                per_agent: int = 1, pre_add: bool = True, slices: int = 1,
                workers: int = 1, arch: str = "mobilenet_v1",
                precision: str = "float32") -> dict:
    services = Services(root, mode, pg, rd, workers)
    services.start()
    stop, log = mp.Event(), mp.Queue()
    procs: list[mp.Process] = []
    try:
        devices = enroll(services.url, n)
        groups = [devices[i::min(n, 8)] for i in range(min(n, 8))]
        procs = [mp.Process(target=agent_process, args=(services.url, g, stop, log, pre_add),
                            daemon=True) for g in groups]
        for p in procs:
            p.start()
        spec = {"name": f"coord-{n}", "model": {"arch": arch}, "dataset": DATASET,
                "global_batch_size": 4 * n * per_agent, "shards": n * per_agent,
                "epochs": 1000, "seed": 0,
                "checkpoint_every": 100000, "optimizer": {"lr": 0.01}, "slices": slices,
                "upload_precision": precision,
                "placement": {"min_devices": n, "max_devices": n}}
        admin = {"Authorization": f"Bearer {ADMIN}"}
        # the API process apart from the workers: the data plane's CPU, process by process
        groups_pids = {"api": [p.pid for p in services.procs if p not in services.worker_procs],
                       **{f"worker{i}": [p.pid] for i, p in enumerate(services.worker_procs)},
                       "agents": [p.pid for p in procs]}
        with httpx.Client(base_url=services.url, headers=admin, timeout=60) as c:
            job_id = c.post("/v1/jobs", json=spec).json()["id"]
            deadline = time.monotonic() + 600
            cpu_before: dict[str, float] = {}
            faults_before: dict[str, float] = {}
            while (at := c.get(f"/v1/jobs/{job_id}").json()["step"]) < steps + 1:
                assert time.monotonic() < deadline, "steps did not advance"
                if at >= 1 and not cpu_before:
                    cpu_before, first = cpu_seconds(groups_pids), at
                    faults_before = page_faults(groups_pids)
                time.sleep(0.25)  # the bench's own polling is load on the server too
            cpu_after = cpu_seconds(groups_pids)
            faults_after = page_faults(groups_pids)
            # the processes this run started (Redis's and Postgres's peaks span their lives)
            peak_rss = {g: v for g, v in _by_group(groups_pids, process_peak_rss()).items()
                        if g in groups_pids}
            rows = c.get(f"/v1/jobs/{job_id}/metrics").json()["items"]
            c.post(f"/v1/jobs/{job_id}/cancel")
    finally:
        stop.set()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
        services.stop()
    local: dict[int, float] = {}
    marks: dict[int, list[tuple[float, float, float, float]]] = {}
    sent: dict[int, int] = {}  # bytes uploaded in each step, by all agents
    while not log.empty():
        step, seconds, times, nbytes = log.get()
        local[step] = max(seconds, local.get(step, 0.0))
        marks.setdefault(step, []).append(times)
        sent[step] = sent.get(step, 0) + nbytes
    measured = [r for r in rows if 1 <= r["step"] <= steps and r["step_seconds"]]
    wall = [r["step_seconds"] for r in measured]
    coord = [r["step_seconds"] - local.get(r["step"], 0.0) for r in measured]
    cpu = {g: (cpu_after[g] - cpu_before.get(g, 0.0)) / max(1, at - first) for g in cpu_after}
    faults = {g: (faults_after[g] - faults_before.get(g, 0)) / max(1, at - first)
              for g in faults_after}
    per_step = [sent[r["step"]] for r in measured if r["step"] in sent]
    return {"mode": mode, "agents": n, "shards_per_agent": per_agent, "pre_add": pre_add,
            "slices": slices, "workers": workers if mode == "redis" else 0,
            "upload_bytes_per_agent_step": statistics.median(per_step) / n if per_step else None,
            "model_bytes": 4 * n_params_of(arch), "arch": arch, "precision": precision, "step_wall_s": statistics.median(wall),
            "cpu_s_per_step": cpu,
            "page_faults_per_step": faults, "peak_rss_bytes": peak_rss,
            "slowest_agent_local_s": statistics.median(local.get(r["step"], 0.0) for r in measured),
            "coordination_s": statistics.median(coord), "steps": len(measured),
            "phases_s": step_phases(marks, [r["step"] for r in measured])}


def step_phases(marks: dict[int, list[tuple[float, ...]]], steps: list[int]) -> dict[str, float]:
    """Where a step's wall time goes, from the agents' clocks (one machine, one clock), median
    over steps: `download` first work answer -> last weights received; `upload` first upload
    sent -> last upload answered; `apply` last upload answered -> first work answer of the
    next step (apply_step, the commit and waking the long polls)."""
    phases: dict[str, list[float]] = {"download": [], "upload": [], "apply": []}
    for step in steps:
        this, after = marks.get(step), marks.get(step + 1)
        if not this or not after:
            continue
        phases["download"].append(max(m[1] for m in this) - min(m[0] for m in this))
        phases["upload"].append(max(m[3] for m in this) - min(m[2] for m in this))
        phases["apply"].append(min(m[0] for m in after) - max(m[3] for m in this))
    return {k: statistics.median(v) for k, v in phases.items() if v}


def _by_group(groups: dict[str, list[int]],
              readings: Iterable[tuple[int, str, float]]) -> dict[str, float]:
    """Each group's sum of a per-process reading, plus Redis and Postgres by process name."""
    owner = {pid: g for g, pids in groups.items() for pid in pids}
    totals = dict.fromkeys([*groups, "redis", "postgres"], 0.0)
    for pid, name, value in readings:
        group = owner.get(pid) or ("redis" if name.startswith("redis") else
                                   "postgres" if name.startswith("postgres") else None)
        if group:
            totals[group] += value
    return totals


def cpu_seconds(groups: dict[str, list[int]]) -> dict[str, float]:
    """CPU time so far (user + system) of each group of processes: on a 2-core machine the
    step is as fast as its total CPU allows."""
    return _by_group(groups, process_cpu())


def page_faults(groups: dict[str, list[int]]) -> dict[str, float]:
    """Minor page faults so far of the same groups (Redis's were its 25.7 MB state write's
    buffer, faulted in afresh each step until values went into Redis in parts)."""
    return _by_group(groups, process_faults())


def gloo_worker(rank: int, world: int, port: int, repeats: int, out: Any, n_params: int) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    x = torch.zeros(n_params, dtype=torch.float32)
    times = []
    for i in range(repeats + 2):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(x)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    out.put((rank, times))
    dist.destroy_process_group()


def run_gloo(n: int, repeats: int = 20, n_params: int = N_PARAMS) -> dict:
    """Median over `repeats` allreduces of the slowest rank's time (5 repeats varied by 1.5x
    between runs on this shared machine; 20 settle it)."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=gloo_worker, args=(r, n, port, repeats, out, n_params)) for r in range(n)]
    for p in procs:
        p.start()
    per_rank = [out.get(timeout=600)[1] for _ in range(n)]
    for p in procs:
        p.join(30)
    slowest = [max(ts[i] for ts in per_rank) for i in range(repeats)]
    return {"agents": n, "allreduce_s": statistics.median(slowest)}


def start_compose_redis() -> str:
    """A redis-server run with docker-compose.yml's command and environment for its Redis (no
    persistence, the allocator keeping freed pages: docs/deploy.md), stopped at exit."""
    import atexit

    import redis
    import yaml

    service = yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]["redis"]
    env = {**os.environ, **{k: str(v) for k, v in (service.get("environment") or {}).items()}}
    port, data = free_port(), tempfile.TemporaryDirectory(prefix="bench-redis-")
    proc = subprocess.Popen([*service["command"], "--port", str(port), "--bind", "127.0.0.1",
                             "--dir", data.name], env=env, stdout=subprocess.DEVNULL)

    def stop() -> None:
        proc.terminate()
        proc.wait(timeout=30)
        data.cleanup()

    atexit.register(stop)
    url = f"redis://127.0.0.1:{port}/0"
    for _ in range(100):
        try:
            if redis.Redis.from_url(url).info("server")["process_id"] != proc.pid:
                raise RuntimeError(f"another Redis answers on port {port}")
            return url
        except redis.ConnectionError:
            if proc.poll() is not None:
                break
            time.sleep(0.1)
    raise RuntimeError("the compose Redis command did not start")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--agents", default="4,8,16,64")
    parser.add_argument("--modes", default="embedded,redis")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--gloo-max", type=int, default=16)
    parser.add_argument("--shards-per-agent", type=int, default=1,
                        help="k: each agent holds k shards (an aligned block of the tree)")
    parser.add_argument("--pre-add", default="on",
                        help="on, off or on,off: agents pre-add their shards (issue 21 item 1)")
    parser.add_argument("--slices", default="1",
                        help="P or P,Q: the job's vector in P slices (issue 21 item 2)")
    parser.add_argument("--workers", type=int, default=1,
                        help="phalanx worker processes in mode redis")
    parser.add_argument("--arch", default="mobilenet_v1",
                        help="the job's model: its parameter count is the vector moved")
    parser.add_argument("--precision", default="float32",
                        help="the job's upload_precision (bfloat16: half the bytes up)")
    parser.add_argument("--pg-url", default=os.environ.get("PHALANX_TEST_DATABASE_URL"))
    parser.add_argument("--redis-url", default=os.environ.get("PHALANX_TEST_REDIS_URL"),
                        help="`compose`: a redis-server of this machine started as "
                             "docker-compose.yml runs Redis (its command and environment)")
    args = parser.parse_args()
    if args.redis_url == "compose":
        args.redis_url = start_compose_redis()
    counts = [int(a) for a in args.agents.split(",")]
    results: list[dict] = []
    runs = [(mode, n, pre == "on", int(p)) for mode in args.modes.split(",") for n in counts
            for pre in args.pre_add.split(",") for p in args.slices.split(",")]
    gloo_counts = [n for n in counts if n <= args.gloo_max]
    # gloo before and after the Phalanx runs, each ratio against the mean of the two: on a
    # shared machine one measurement drifted 41-64 ms between runs of minutes
    n_params = n_params_of(args.arch)
    gloo_before = {n: run_gloo(n, n_params=n_params)["allreduce_s"] for n in gloo_counts}
    for mode, n, pre_add, slices in runs:
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
            pg = fresh_pg(args.pg_url) if mode == "redis" else None
            try:
                row = run_phalanx(Path(tmp), mode, n, args.steps, pg, args.redis_url,
                                  args.shards_per_agent, pre_add, slices, args.workers,
                                  args.arch, args.precision)
            finally:
                drop_pg(args.pg_url, pg)
        results.append(row)
        per_agent = args.shards_per_agent
        if per_agent > 1 and row["upload_bytes_per_agent_step"]:
            print(f"{per_agent} shards per agent, pre-added: {'yes' if pre_add else 'no '}: uploaded "
                  f"{row['upload_bytes_per_agent_step'] / row['model_bytes']:.2f} x M per "
                  f"agent and step (bound 1 + ceil(log2 {per_agent}) = "
                  f"{1 + (per_agent - 1).bit_length()})", flush=True)
        print(f"phalanx {mode:8} {n:>3} agents, {slices} slice(s): step {row['step_wall_s'] * 1000:7.0f} ms, "
              f"agent-local {row['slowest_agent_local_s'] * 1000:5.0f} ms, coordination "
              f"{row['coordination_s'] * 1000:7.0f} ms | CPU per step: " + ", ".join(
                  f"{g} {v * 1000:.0f} ms" for g, v in row["cpu_s_per_step"].items() if v)
              + " | phases: " + ", ".join(f"{k} {v * 1000:.0f} ms"
                                          for k, v in row["phases_s"].items())
              + " | page faults per step: " + ", ".join(
                  f"{g} {v:.0f}" for g, v in row["page_faults_per_step"].items() if v)
              + " | peak RSS: " + ", ".join(f"{g} {v / 2**20:.0f} MiB"
                                            for g, v in row["peak_rss_bytes"].items()),
              flush=True)
    gloo = {}
    for n in gloo_counts:
        after = run_gloo(n, n_params=n_params)["allreduce_s"]
        gloo[n] = (gloo_before[n] + after) / 2
        print(f"gloo allreduce {n:>3} processes: {gloo[n] * 1000:7.0f} ms (before "
              f"{gloo_before[n] * 1000:.0f}, after {after * 1000:.0f})", flush=True)
    for row in results:
        if row["agents"] in gloo:
            row["gloo_allreduce_s"] = gloo[row["agents"]]
            row["ratio_vs_gloo"] = row["coordination_s"] / row["gloo_allreduce_s"]
            print(f"ratio {row['mode']:8} {row['agents']:>3} agents: "
                  f"phalanx/gloo = {row['ratio_vs_gloo']:.2f}")
    print(json.dumps(results))


def fresh_pg(admin_url: str | None) -> str | None:
    if not admin_url:
        return None
    from tests.support.databases import PostgresTemplate

    template = PostgresTemplate(admin_url)
    name = template.name.replace("tmpl", "bench")
    template._execute(f'CREATE DATABASE "{name}"')
    return admin_url.rpartition("/")[0] + "/" + name


def drop_pg(admin_url: str | None, url: str | None) -> None:
    if admin_url and url:
        from tests.support.databases import PostgresTemplate

        PostgresTemplate(admin_url).drop_clone(url)


if __name__ == "__main__":
    main()
