"""What a job's upload precision costs the model: the digits cnn (DESIGN.md's spec) trained by
the reference trainer with float32, bfloat16 and float16 uploads, five seeds each (the
run-to-run spread is the yardstick). `python bench/upload_precision_accuracy.py`; the table is
in docs/benchmarks.md."""

from __future__ import annotations

from typing import Any

from phalanx.train_local import run_reference

SPEC: dict[str, Any] = {
    "name": "digits-cnn", "model": {"arch": "cnn"}, "dataset": "digits",
    "global_batch_size": 256, "shards": 16, "epochs": 20,
    "optimizer": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.0001, "warmup_epochs": 2,
                  "schedule": "cosine"},
}
SEEDS = range(5)


def mean(rows: list[dict[str, Any]], key: str) -> float:
    return sum(float(r[key]) for r in rows) / len(rows)


def main() -> None:
    print("| upload precision | mean final train loss | mean val loss | mean val accuracy (range over 5 seeds) |")
    for precision in ("float32", "bfloat16", "float16"):
        rows = [run_reference(dict(SPEC, seed=s, upload_precision=precision), None,
                              progress=False) for s in SEEDS]
        accuracies = [100 * float(r["val_accuracy"]) for r in rows]
        print(f"| {precision} | {mean(rows, 'train_loss'):.4f} | {mean(rows, 'val_loss'):.4f} | "
              f"{sum(accuracies) / len(accuracies):.2f}% ({min(accuracies):.2f}-"
              f"{max(accuracies):.2f}) |", flush=True)


if __name__ == "__main__":
    main()
