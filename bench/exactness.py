"""Portable vs class: one shard's forward + backward time (engine.compute_shard) with each
kernel set, same model, weights and data, on 1 and 2 BLAS threads.

Run:  env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/exactness.py [--reps 5]
      [--models cnn,resnet18,mobilenet_v2,resnet50] [--threads 1,2]
Each thread count runs in its own process (BLAS sizes its pool at import). Within a process the
two kernel sets alternate rep by rep, so machine noise hits both alike; the best of the reps is
kept. Prints one JSON line per (model, threads): class and portable seconds and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# model -> (spec model fields, input shape, classes, samples per shard): the examples' sizes
CASES = {
    "cnn": ({"arch": "cnn"}, (1, 8, 8), 10, 16),  # examples/digits-cnn.yaml: 256 / 16 shards
    "resnet18": ({"arch": "resnet18", "width": 0.25}, (3, 64, 64), 10, 8),  # resnet18-synthetic
    "mobilenet_v2": ({"arch": "mobilenet_v2", "width": 0.5}, (3, 64, 64), 10, 8),
    "resnet50": ({"arch": "resnet50"}, (3, 224, 224), 1000, 4),  # resnet50-224: 64 / 16
}


def measure(model_name: str, reps: int) -> dict[str, float]:
    import numpy as np

    from engine.models import build_model
    from engine.spec import TrainSpec
    from engine.step import compute_shard, initial_state

    fields, shape, classes, samples = CASES[model_name]
    specs = {e: TrainSpec.from_job_spec({"model": fields, "dataset": "bench", "exactness": e,
                                         "global_batch_size": samples, "shards": 1})
             for e in ("class", "portable")}
    model = build_model(fields["arch"], shape, classes, specs["class"].model_options)
    state = initial_state(model, specs["class"])
    rng = np.random.default_rng(0)
    x = rng.standard_normal((samples, *shape)).astype(np.float32)
    y = rng.integers(0, classes, samples)
    times: dict[str, list[float]] = {e: [] for e in specs}
    for spec in specs.values():  # warm-up
        compute_shard(model, state.params, state.buffers, x, y, spec, 0, 0)
    for _ in range(reps):
        for name, spec in specs.items():
            t0 = time.perf_counter()
            compute_shard(model, state.params, state.buffers, x, y, spec, 0, 0)
            times[name].append(time.perf_counter() - t0)
    return {name: min(v) for name, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--models", default=",".join(CASES))
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the child's (model) run
    args = parser.parse_args()
    if args.one:
        sys.path.insert(0, str(ROOT))
        print(json.dumps(measure(args.one, args.reps)))
        return
    for model_name in args.models.split(","):
        for threads in [int(t) for t in args.threads.split(",")]:
            env = {**os.environ, "OPENBLAS_NUM_THREADS": str(threads),
                   "OMP_NUM_THREADS": str(threads)}
            out = subprocess.run([sys.executable, __file__, "--one", model_name, "--reps",
                                  str(args.reps)], env=env, capture_output=True, text=True,
                                 check=True)
            t = json.loads(out.stdout.strip().splitlines()[-1])
            print(json.dumps({"model": model_name, "threads": threads,
                              "class_s": round(t["class"], 4),
                              "portable_s": round(t["portable"], 4),
                              "portable_over_class": round(t["portable"] / t["class"], 2)}),
                  flush=True)


if __name__ == "__main__":
    main()
