"""The single-process reference trainer: the distributed job's math, in one loop.

Every step computes every shard's gradient sum with `compute_shard` and applies them with the
same `apply_step` the scheduler uses, so a cluster run of the same spec ends where this ends
(DESIGN.md invariant 1). With `eval_every` it validates the weights of those steps with
engine.validation, as the cluster's step commit does: the metrics' `validation` is the curve.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.checkpoint import save_npz, state_to_arrays
from engine.data import load_dataset
from engine.optim import lr_at
from engine.runner import final_metrics, job_model, shard_gradient
from engine.sampler import shard_indices
from engine.step import apply_step, initial_state
from engine.stored import Samples
from engine.validation import ValidationPoint, validate, validation_due


@dataclass(frozen=True)
class EpochRow:
    epoch: int
    step: int
    train_loss: float
    train_accuracy: float
    val_loss: float | None
    val_accuracy: float | None
    lr: float
    samples_per_s: float


def run_reference(spec: dict[str, Any], out_dir: Path | None, progress: bool = True,
                  data_dir: str | Path | None = None, backend: str = "numpy",
                  on_epoch: Callable[[EpochRow], None] | None = None) -> dict[str, Any]:
    """Train `spec` to the end; write checkpoint.npz and metrics.json to out_dir if given.
    numpy's BLAS runs on one thread, as on every phone (agent.runtime.executor.blas_threads):
    more threads give other bits."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1, user_api="blas"):
        return _run_reference(spec, out_dir, progress, data_dir, backend, on_epoch)


def _run_reference(spec: dict[str, Any], out_dir: Path | None, progress: bool,
                   data_dir: str | Path | None, backend: str,
                   on_epoch: Callable[[EpochRow], None] | None) -> dict[str, Any]:
    data = load_dataset(str(spec.get("dataset", "")), data_dir)
    job = job_model(spec, len(data.y_train), data.input_shape, data.num_classes)
    ts, model = job.spec, job.model
    parts = shard_indices(len(data.y_train), ts.shards, ts.seed)
    # an upload stays on disk: each step reads its micro-batches' rows (engine.stored)
    x_train = data.x_train
    shards = [(x_train.take(idx) if isinstance(x_train, Samples) else x_train[idx],
               data.y_train[idx]) for idx in parts]
    state = initial_state(model, ts)
    spe, total = ts.steps_per_epoch, ts.total_steps
    rows: list[EpochRow] = []
    curve: list[ValidationPoint] = []
    display = _Display(total, progress)
    start = time.perf_counter()
    with display:
        for epoch in range(ts.epochs):
            t0, losses, accs = time.perf_counter(), [], []
            for _ in range(spe):
                results = [shard_gradient(job, state.params, state.buffers, xs, ys, state.step,
                                          k, backend) for k, (xs, ys) in enumerate(shards)]
                state, m = apply_step(model, ts, state, results)
                losses.append(m.train_loss)
                accs.append(m.train_accuracy)
                display.advance(m.train_loss)
                if validation_due(ts, state.step):
                    v0 = time.perf_counter()
                    curve += [p for p in [validate(job, state, data.x_val, data.y_val)] if p]
                    t0 += time.perf_counter() - v0  # an epoch's samples/s: its steps' time
            done = curve[-1] if curve and curve[-1].step == state.step - 1 else None
            row = _epoch_row(job, state, data, epoch, losses, accs, spe, t0, done)
            rows.append(row)
            display.epoch(row)
            if on_epoch is not None:
                on_epoch(row)
    seconds = time.perf_counter() - start
    last = rows[-1]  # its validation ran on the final weights: not again
    validated = None if last.val_loss is None else (last.val_loss, last.val_accuracy)
    metrics = {"val_loss": None, "val_accuracy": None,
               **final_metrics(job, state, losses, accs, data.x_val, data.y_val, validated),
               "validation": [asdict(p) for p in curve],
               "seconds": round(seconds, 3),
               "samples_per_s": round(state.step * ts.global_batch_size / max(seconds, 1e-9), 1)}
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "checkpoint.npz").write_bytes(save_npz(state_to_arrays(model, state)))
        (out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    return metrics


def _epoch_row(job, state, data, epoch, losses, accs, spe, t0,
               validated: ValidationPoint | None) -> EpochRow:
    """The epoch's line; its validation is the curve's point of this step when it has one."""
    seconds = time.perf_counter() - t0
    ts = job.spec
    point = validated or validate(job, state, data.x_val, data.y_val)
    return EpochRow(epoch + 1, state.step, float(np.mean(losses)), float(np.mean(accs)),
                    point.val_loss if point else None, point.val_accuracy if point else None,
                    lr_at(ts, state.step - 1), spe * ts.global_batch_size / max(seconds, 1e-9))


class _Display:
    """A rich progress bar on stderr (stdout stays for the table and the metrics line)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.progress, self.task = total, enabled, None, None

    def __enter__(self) -> _Display:
        if self.enabled:
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
            )

            self.progress = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[loss]}"), TimeRemainingColumn(),
                                     console=Console(stderr=True), transient=True)
            self.progress.start()
            self.task = self.progress.add_task("train", total=self.total, loss="")
        return self

    def advance(self, loss: float) -> None:
        if self.progress is not None:
            self.progress.update(self.task, advance=1, loss=f"loss {loss:.4f}")

    def epoch(self, row: EpochRow) -> None:
        if self.progress is not None:
            val = "-" if row.val_accuracy is None else f"{row.val_accuracy:.4f}"
            self.progress.console.print(
                f"epoch {row.epoch:>4}  loss {row.train_loss:.4f}  acc {row.train_accuracy:.4f}"
                f"  val_acc {val}  {row.samples_per_s:,.0f} samples/s")

    def __exit__(self, *exc: object) -> None:
        if self.progress is not None:
            self.progress.stop()
