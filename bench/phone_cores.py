"""Every core of a phone, exactly: a compute worker given 1 thread against one given 2, on the
same step of a job whose phone holds 4 shards (the agent's real worker subprocess, numpy).

Run:  .venv/bin/python bench/phone_cores.py [--reps 5] [--arch resnet18 --width 0.25]
      [--pre-reduce]   (upload one pre-added partial, as agents do: engine.tree)

Each worker computes the step's 4 shards (the 2-thread one two at a time, side by side, one
single-threaded BLAS each); reps alternate the two so machine noise hits both alike. Prints the
best-of-reps step time of each, the speedup (target >= 1.7x on a 2-core machine) and whether
the uploaded bytes are identical (they must be), and the page faults a step costs (on a phone:
whether its allocator hands each shard fresh pages, as glibc's did before the agent's tunables).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agent.runtime.executor import ComputeWorker, ExecConfig  # noqa: E402
from bench.proc_cpu import faults_of  # noqa: E402
from engine.data import dataset_info, load_dataset  # noqa: E402
from engine.runner import job_model  # noqa: E402
from engine.sampler import shard_indices  # noqa: E402
from engine.step import initial_state  # noqa: E402
from wire.messages import encode_weights  # noqa: E402


def request(tmp: Path, arch: str, width: float, shards_held: int,
            pre_reduce: bool = False) -> dict:
    spec = {"name": "cores", "model": {"arch": arch, "width": width},
            "dataset": "synthetic:3x32x32:10:2048", "global_batch_size": 512, "shards": 16,
            "epochs": 1, "seed": 0}
    info = dataset_info(spec["dataset"])
    job = job_model(spec, info.n_train, info.input_shape, info.num_classes)
    state = initial_state(job.model, job.spec)
    weights = tmp / "weights.bin"
    weights.write_bytes(encode_weights("job-bench", 0, state.params, state.buffers))
    data = load_dataset(spec["dataset"])
    paths = {}
    for k, idx in enumerate(shard_indices(info.n_train, 16, 0)):
        if k == shards_held:
            break
        path = tmp / f"shard-{k}.npz"
        np.savez(path, x=data.x_train[idx].astype(np.float32), y=data.y_train[idx])
        paths[str(k)] = str(path)
    return {"op": "step", "job_id": "job-bench", "step": 0, "spec": spec,
            "n_train": info.n_train, "input_shape": list(info.input_shape),
            "num_classes": info.num_classes, "weights_path": str(weights), "shards": paths,
            "pre_reduce": pre_reduce}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--arch", default="resnet18")
    ap.add_argument("--width", type=float, default=0.25)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--pre-reduce", action="store_true",
                    help="upload one pre-added partial, as agents do (engine.tree)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        req = request(tmp, args.arch, args.width, args.shards, args.pre_reduce)
        workers = {n: ComputeWorker(ExecConfig("numpy", n)) for n in (1, 2)}
        times: dict[int, list[float]] = {1: [], 2: []}
        compute: dict[int, list[float]] = {1: [], 2: []}
        out: dict[int, bytes] = {}
        faults: dict[int, list[int]] = {1: [], 2: []}
        try:
            reply_pids: dict[int, list[int]] = {}
            for n, w in workers.items():  # warm-up: imports, first-call allocations
                reply_pids[n] = w.request({**req, "out_path": str(tmp / f"warm-{n}.bin")}).get(
                    "helper_pids", [])
            for _ in range(args.reps):
                for n, w in workers.items():
                    path = tmp / f"out-{n}.bin"
                    before = faults_of([w.pid, *reply_pids.get(n, [])])
                    t0 = time.perf_counter()
                    reply = w.request({**req, "out_path": str(path)})
                    times[n].append(time.perf_counter() - t0)
                    reply_pids[n] = reply.get("helper_pids", [])
                    faults[n].append(faults_of([w.pid, *reply_pids[n]]) - before)
                    compute[n].append(reply["compute_s"])
                    out[n] = path.read_bytes()
        finally:
            for w in workers.values():
                w.close()
    print(f"{args.arch} width {args.width}, 3x32x32, micro-batch 32, {args.shards} shards "
          f"held, {args.reps} reps alternating")
    for what, series in (("computing the shards", compute), ("the whole step request "
                                                               "(+ encoding the upload)", times)):
        one, two = min(series[1]), min(series[2])
        print(f"{what}: 1 thread {one * 1000:.1f} ms, 2 threads {two * 1000:.1f} ms, "
              f"speedup {one / two:.2f}x")
    print(f"same bytes uploaded: {out[1] == out[2]} ({len(out[1]):,} bytes)")
    print(f"page faults a step (the worker and its helpers; thousands mean the allocator gives "
          f"each shard fresh pages): 1 thread {min(faults[1]):,}, 2 threads {min(faults[2]):,}")



if __name__ == "__main__":
    main()
