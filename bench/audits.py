"""What audits cost (issue 41): a job's step time at audit rates 0, 0.02, 0.1 and 1.0, the rates
alternated in one run, each step's time over rate 0's of the same round.

    .venv/bin/python bench/audits.py [--phones 6] [--steps 30] [--rounds 3]

A fleet of `--phones` phones per rate, each its own job (a phone holds one job), probation 0
(steady state: a phone on probation costs what rate 1.0 costs). The server's path is the real
one, in this process: the step protocol (`api.steps.protocol.StepProtocol`: work answers,
uploads, audit uploads kept apart) and the apply pipeline (`run_apply_step`: the audits
checked in its plan, assigned in its commit), on SQLite and the in-memory blob store. The
phones are threads that behave as phones of one core each: their results are the engine's
(computed before the step, untimed, so the audits compare real bytes), and each "computes"
for its shards by sleeping `--shard-ms` a shard (default 50 ms; 0: the engine's time here),
so phones work side by side as a fleet does and a step lasts as long as its slowest phone,
audits included, plus the server's work.
Printed: per rate, the median step time, its ratio to rate 0 (median of the rounds' ratios),
audited nodes per step, and the fleet's compute per step over rate 0's.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from agent.runtime.agent import FEATURES, compute_class
from api.steps.protocol import StepProtocol
from domain.settings import Settings
from domain.store.db import make_engine, make_session_factory, transaction, upgrade
from domain.store.models import Device, Job, utcnow
from domain.tuning import Tuning
from engine import tree
from engine.data import load_dataset
from engine.jobinfo import job_info
from engine.runner import shard_gradient
from engine.sampler import shard_indices
from engine.step import ShardResult, pre_reduce
from hotstate.blobs import MemoryBlobStore
from scheduler.context import SchedulerContext
from scheduler.tasks.reconcile import run_reconcile, run_reconcile_job
from scheduler.tasks.recovery import load_state
from scheduler.tasks.steps import run_apply_step
from wire.messages import encode_results
from wire.states import DeviceState, JobState

RATES = (0.0, 0.02, 0.1, 1.0)
DATASET = "synthetic:1x16x16:10:8192"
ARCH = "mlp"  # light to compute before each step: the phones' time is --shard-ms


def spec(rate: float, shards: int, phones: int) -> dict[str, Any]:
    return {"name": f"audits-{rate}", "model": {"arch": ARCH}, "dataset": DATASET,
            "global_batch_size": 32 * shards, "shards": shards, "epochs": 1000, "seed": 0,
            "checkpoint_every": 100000,
            "placement": {"min_devices": phones, "max_devices": phones,
                          "selector": {"rate": str(rate)}},
            "verification": {"audit_rate": rate, "probation_steps": 0}}


class Bench:
    def __init__(self, root: Path, phones: int, shards: int) -> None:
        url = f"sqlite:///{root / 'bench.sqlite'}"
        upgrade(url)
        settings = Settings(database_url=url, data_dir=root)
        factory = make_session_factory(make_engine(url))
        blobs = MemoryBlobStore()
        self.ctx = SchedulerContext(settings, factory, blobs, tuning=Tuning())
        self.protocol = StepProtocol(factory, blobs, root, utcnow)
        self.phones, self.shards = phones, shards
        self.jobs: dict[float, str] = {}
        self.devices: dict[float, list[str]] = {}

    def start(self, rate: float) -> None:
        job_spec = spec(rate, self.shards, self.phones)
        ids = [f"dev-{rate}-{i}" for i in range(self.phones)]
        with transaction(self.ctx.session_factory) as s:
            for device in ids:
                s.add(Device(id=device, name=device, state=DeviceState.READY.value,
                             labels={"rate": str(rate)}, lease_renewed_at=utcnow(),
                             profiles={ARCH: {"samples_per_s": 100.0}},
                             latest_telemetry={"battery_pct": 90, "charging": True},
                             capabilities={"features": list(FEATURES),
                                           "compute_class": compute_class()}))
            job = Job(name=job_spec["name"], spec=job_spec, state=JobState.PENDING.value,
                      total_steps=job_info("b", job_spec, self.ctx.settings.data_dir).total_steps)
            s.add(job)
            s.flush()
            job_id = job.id
        run_reconcile(self.ctx)
        run_reconcile_job(self.ctx, job_id)
        self.jobs[rate], self.devices[rate] = job_id, ids

    def leaves(self, job_id: str, step: int) -> dict[int, ShardResult]:
        """Every shard's result of the step, from the stored state (the engine's)."""
        with self.ctx.session_factory() as s:
            row = s.get(Job, job_id)
            nonce, job_spec = row.state_nonce, dict(row.spec)
        info = job_info(job_id, job_spec, self.ctx.settings.data_dir)
        state = load_state(self.ctx, job_id, step, nonce, info.slices)
        data = load_dataset(info.spec.dataset)
        return {k: shard_gradient(info, state.params, state.buffers, data.x_train[idx],
                                  data.y_train[idx], step, k)
                for k, idx in enumerate(shard_indices(info.n_train, info.spec.shards,
                                                      info.spec.seed))}

    def step(self, rate: float, shard_s: float) -> tuple[float, float, int]:
        """One step of the rate's job played by its phones: (seconds, phone-seconds of
        compute, nodes audited)."""
        job_id = self.jobs[rate]
        with self.ctx.session_factory() as s:
            step = s.get(Job, job_id).step
        leaves = self.leaves(job_id, step)  # untimed: what each phone would compute
        done = threading.Event()
        busy = [0.0]
        audited = [0]
        lock = threading.Lock()

        def phone(device: str) -> None:
            while not done.is_set():
                a = self.protocol.work(device)
                if a is None or a.step != step:
                    done.wait(0.001)
                    continue
                results = pre_reduce([leaves[k] for k in a.shards], self.shards, "float32")
                own = set(a.shards) <= set(self.protocol.view(device).held.get(job_id, ()))
                time.sleep(shard_s * len(a.shards))  # one core's compute
                with lock:
                    busy[0] += shard_s * len(a.shards)
                    audited[0] += 0 if own else len(tree.cover(a.shards, self.shards))
                up = self.protocol.upload(device, job_id, step,
                                          encode_results(job_id, step, results))
                if up.complete and run_apply_step(self.ctx, job_id, step) == "applied":
                    done.set()

        threads = [threading.Thread(target=phone, args=(d,)) for d in self.devices[rate]]
        started = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return time.perf_counter() - started, busy[0], audited[0]


def shard_seconds(bench: Bench) -> float:
    """A shard's compute on one core of this machine (median of a few)."""
    job_id = next(iter(bench.jobs.values()))
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        bench.leaves(job_id, 0)
        times.append((time.perf_counter() - t0) / bench.shards)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phones", type=int, default=6)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--steps", type=int, default=30, help="steps a rate, each round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shard-ms", type=float, default=50.0,
                        help="a phone's time for one shard (0: the engine's here, measured)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        bench = Bench(Path(tmp), args.phones, args.shards)
        for rate in RATES:
            bench.start(rate)
        shard_s = args.shard_ms / 1000 if args.shard_ms > 0 else shard_seconds(bench)
        times: dict[float, list[float]] = {r: [] for r in RATES}
        work: dict[float, list[float]] = {r: [] for r in RATES}
        nodes: dict[float, list[int]] = {r: [] for r in RATES}
        ratios: dict[float, list[float]] = {r: [] for r in RATES}
        for rate in RATES:  # a warm-up step each: caches, allocators, the first audits
            bench.step(rate, shard_s)
        for _ in range(args.rounds):
            medians = {}
            for rate in RATES:  # the rates alternate within each round
                got = [bench.step(rate, shard_s) for _ in range(args.steps)]
                times[rate] += [g[0] for g in got]
                work[rate] += [g[1] for g in got]
                nodes[rate] += [g[2] for g in got]
                medians[rate] = statistics.median(g[0] for g in got)
            for rate in RATES:
                ratios[rate].append(medians[rate] / medians[0.0])
    print(f"{args.phones} phones, {args.shards} shards, {ARCH} on {DATASET}, a shard "
          f"{shard_s * 1000:.1f} ms on a phone's core; {args.rounds} rounds of {args.steps} "
          f"steps a rate")
    print("| audit_rate | step time (median) | x rate 0 (median of rounds) | mean step time "
          "x rate 0 | audited nodes a step | fleet compute x rate 0 |")
    print("| --- | --- | --- | --- | --- | --- |")
    base_mean = statistics.mean(times[0.0])
    base_work = statistics.mean(work[0.0])
    for rate in RATES:
        print(f"| {rate} | {statistics.median(times[rate]) * 1000:.0f} ms | "
              f"{statistics.median(ratios[rate]):.3f} | "
              f"{statistics.mean(times[rate]) / base_mean:.3f} | "
              f"{statistics.mean(nodes[rate]):.2f} | "
              f"{statistics.mean(work[rate]) / base_work:.3f} |")


if __name__ == "__main__":
    main()
