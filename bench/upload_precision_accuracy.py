"""What a job's upload precision costs the model: the digits cnn (DESIGN.md's spec) trained by
the reference trainer with float32, bfloat16 and float16 uploads, five seeds each (the
run-to-run spread is the yardstick). `python bench/upload_precision_accuracy.py [--job
synthetic224] [--seeds 5]`; the tables are in docs/benchmarks.md.

`synthetic224`: a small conv net (a user's layer graph) at 3x224x224 on a learnable synthetic
set (each class a smooth spatial pattern under noise, engine.data): the size of input the seed
papers train on, a model small enough to train a few epochs on 2 cores."""

from __future__ import annotations

import argparse
from typing import Any

from phalanx.train_local import run_reference

SPEC: dict[str, Any] = {
    "name": "digits-cnn", "model": {"arch": "cnn"}, "dataset": "digits",
    "global_batch_size": 256, "shards": 16, "epochs": 20,
    "optimizer": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.0001, "warmup_epochs": 2,
                  "schedule": "cosine"},
}
SPEC_224: dict[str, Any] = {
    "name": "synthetic-224",
    # a user's own layer graph: a strided conv stem and a classifier on the pooled map (the
    # classes are spatial patterns, which a global average pool would average away)
    "model": {"layers": [
        {"type": "conv2d", "out_channels": 16, "kernel": 4, "stride": 4, "padding": 0},
        {"type": "batchnorm"}, {"type": "relu"},
        {"type": "conv2d", "out_channels": 16, "kernel": 3},
        {"type": "batchnorm"}, {"type": "relu"},
        {"type": "maxpool", "kernel": 4},
        {"type": "flatten"}, {"type": "dense", "units": 10}]},
    "dataset": "synthetic:3x224x224:10:1024", "global_batch_size": 64, "shards": 8,
    "epochs": 3,
    "optimizer": {"lr": 0.01, "momentum": 0.9, "weight_decay": 0.0001, "warmup_epochs": 1,
                  "schedule": "cosine"},
}
JOBS = {"digits": SPEC, "synthetic224": SPEC_224}


def mean(rows: list[dict[str, Any]], key: str) -> float:
    return sum(float(r[key]) for r in rows) / len(rows)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", choices=sorted(JOBS), default="digits")
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args()
    spec, seeds = JOBS[args.job], range(args.seeds)
    print(f"| upload precision | mean final train loss | mean val loss | mean val accuracy "
          f"(range over {args.seeds} seeds) |")
    for precision in ("float32", "bfloat16", "float16"):
        rows = [run_reference(dict(spec, seed=s, upload_precision=precision), None,
                              progress=False) for s in seeds]
        accuracies = [100 * float(r["val_accuracy"]) for r in rows]
        print(f"| {precision} | {mean(rows, 'train_loss'):.4f} | {mean(rows, 'val_loss'):.4f} | "
              f"{sum(accuracies) / len(accuracies):.2f}% ({min(accuracies):.2f}-"
              f"{max(accuracies):.2f}) |", flush=True)


if __name__ == "__main__":
    main()
