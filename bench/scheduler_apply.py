"""apply_step reduce throughput (GB/s of gradients reduced) vs numpy summing the same arrays.

    .venv/bin/python bench/scheduler_apply.py [--shards 16] [--repeats 5]

Also printed: the engine's apply_step alone (the tree's sum inside the update's pass) on 1 and
2 threads, min of the repeats; `--engine-only` times only that, in a fresh process.

Phalanx's path is the real task body (`run_apply_step`): read every shard's upload from the
blob store, decode and check it (checksum, finite), the engine's apply_step (float64
accumulation in shard order + SGD), encode and store state t+1, commit the step (SQLite here).
The baseline is numpy adding the same float32 arrays, already in memory, into a float64
accumulator (the same arithmetic, nothing else). Target ratio >= 0.5.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from agent.runtime.agent import FEATURES, compute_class
from domain.settings import Settings
from domain.store.db import make_engine, make_session_factory, transaction, upgrade
from domain.store.models import Device, Job
from domain.tuning import Tuning
from engine.jobinfo import job_info
from engine.step import ShardResult
from hotstate import keys
from hotstate.blobs import MemoryBlobStore
from hotstate.gradstore import pack_result
from scheduler.context import SchedulerContext
from scheduler.tasks.reconcile import run_reconcile, run_reconcile_job
from scheduler.tasks.steps import run_apply_step
from wire.states import DeviceState, JobState

DATASET = "synthetic:3x32x32:10:4096"


def make_context(root: Path) -> SchedulerContext:
    url = f"sqlite:///{root / 'bench.sqlite'}"
    upgrade(url)
    settings = Settings(database_url=url, data_dir=root)
    return SchedulerContext(settings, make_session_factory(make_engine(url)), MemoryBlobStore(),
                            tuning=Tuning())


def start_job(ctx: SchedulerContext, shards: int) -> str:
    spec = {"name": "bench", "model": {"arch": "mobilenet_v1"}, "dataset": DATASET,
            "global_batch_size": 4 * shards, "shards": shards, "epochs": 100, "seed": 0,
            "checkpoint_every": 100000, "placement": {"min_devices": 1, "max_devices": 1}}
    with transaction(ctx.session_factory) as s:
        # a class job stays on the compute class it is first placed on: the device says its own
        s.add(Device(id="dev-bench", name="bench", state=DeviceState.READY.value,
                     lease_renewed_at=ctx.clock(),
                     capabilities={"features": list(FEATURES), "compute_class": compute_class()}))
        job = Job(name="bench", spec=spec, state=JobState.PENDING.value,
                  total_steps=job_info("b", spec, root_dir(ctx)).total_steps)
        s.add(job)
        s.flush()
        job_id = job.id
    run_reconcile(ctx)
    run_reconcile_job(ctx, job_id)
    return job_id


def root_dir(ctx: SchedulerContext) -> Path:
    return ctx.settings.data_dir


def results_for(job_id: str, step: int, grads: list[np.ndarray], n_stats: int, m: int) -> list[bytes]:
    """What the gradient route stores after checking each agent's upload."""
    return [pack_result(ShardResult(k, g, 1.0, 0, m, np.zeros(n_stats, np.float32)))
            for k, g in enumerate(grads)]


def time_update(info, n: int) -> float:
    """The engine's SGD update alone (fixed per step, whatever the number of shards)."""
    from engine.optim import sgd_update

    p = np.zeros(n, np.float32)
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        sgd_update(p, p, p.astype(np.float64), 0.1, 0.9, 1e-4, False, info.model.decay_mask)
        best = min(best, time.perf_counter() - t0)
    return best


def time_engine(shards: int, grads: list[np.ndarray], workers: int, repeats: int) -> float:
    """The engine's apply_step alone (the tree's sum and the update, no store, no checks), on
    `workers` threads: min of `repeats`."""
    from engine.step import apply_step, initial_state

    spec = {"name": "bench", "model": {"arch": "mobilenet_v1"}, "dataset": DATASET,
            "global_batch_size": 4 * shards, "shards": shards, "epochs": 100, "seed": 0}
    info = job_info("engine", spec, None)
    state = initial_state(info.model, info.spec)
    stats = np.zeros(info.model.n_stats, np.float32)
    results = [ShardResult(k, g, 1.0, 0, 4, stats) for k, g in enumerate(grads)]
    best = float("inf")
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        apply_step(info.model, info.spec, state, results, workers=workers)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--engine-only", action="store_true",
                        help="time only the engine's apply_step, in this fresh process")
    args = parser.parse_args()
    if args.engine_only:
        n = job_info("b", {"name": "b", "model": {"arch": "mobilenet_v1"}, "dataset": DATASET},
                     None).model.n_params
        rng = np.random.default_rng(0)
        grads = [rng.standard_normal(n).astype(np.float32) for _ in range(args.shards)]
        print("the engine's apply_step alone (tree sum + update): " + ", ".join(
            f"{time_engine(args.shards, grads, w, args.repeats) * 1000:.1f} ms on {w} thread(s)"
            for w in (1, 2)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        ctx = make_context(Path(tmp))
        job_id = start_job(ctx, args.shards)
        info = job_info(job_id, {"name": "bench", "model": {"arch": "mobilenet_v1"},
                                 "dataset": DATASET}, None)
        n = info.model.n_params
        rng = np.random.default_rng(0)
        grads = [(rng.standard_normal(n) * 1e-3).astype(np.float32) for _ in range(args.shards)]
        phalanx, numpy_t = [], []
        for step in range(args.repeats + 1):  # step 0 warms caches and allocators up
            for k, blob in enumerate(results_for(job_id, step, grads, info.model.n_stats, 4)):
                ctx.blobs.set(keys.grad(job_id, step, k), blob)
            t0 = time.perf_counter()
            assert run_apply_step(ctx, job_id, step) == "applied"
            took = time.perf_counter() - t0
            t0 = time.perf_counter()
            acc = np.zeros(n, dtype=np.float64)
            for g in grads:
                acc += g
            if step:
                phalanx.append(took)
                numpy_t.append(time.perf_counter() - t0)
        update_s = time_update(info, n)
        engine_s = {w: time_engine(args.shards, grads, w, args.repeats) for w in (1, 2)}
    gb = args.shards * n * 4 / 1e9
    # min of repeats: on a shared 2-core machine the minimum is the least disturbed run
    p, q = min(phalanx), min(numpy_t)
    out = {"shards": args.shards, "n_params": n, "gradient_gb": gb,
           "phalanx_s": p, "phalanx_median_s": statistics.median(phalanx), "numpy_s": q,
           "optimizer_update_s": update_s, "phalanx_gb_s": gb / p, "numpy_gb_s": gb / q,
           "ratio": q / p, "ratio_without_update": q / max(p - update_s, 1e-9),
           "engine_apply_s": {str(w): t for w, t in engine_s.items()}}
    print(f"{args.shards} shards x {n:,} params ({gb * 1000:.0f} MB): apply_step {p * 1000:.0f} ms "
          f"= {gb / p:.2f} GB/s; numpy sum {q * 1000:.0f} ms = {gb / q:.2f} GB/s; "
          f"ratio {out['ratio']:.2f} (of which the SGD update, a fixed cost per step, "
          f"{update_s * 1000:.0f} ms; ratio without it {out['ratio_without_update']:.2f})")
    print("the engine's apply_step alone (tree sum + update): " + ", ".join(
        f"{t * 1000:.1f} ms on {w} thread(s)" for w, t in engine_s.items()))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
