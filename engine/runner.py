"""One runner for everything that computes a job: the phone's compute worker
(agent.runtime.worker), the fleet simulator (phalanx.sim.compute), the scheduler
(engine.jobinfo, scheduler.apply) and the reference trainer (phalanx.train_local).

Invariant 1 (a distributed run ends where the reference trainer ends) rests on all of them
building the model from the spec the same way, drawing each shard's micro-batch the same way and
summarising the end the same way: so each of those is defined here once.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine.augment import augment
from engine.graph import Model
from engine.kernels import kernels_for
from engine.models import build_model
from engine.sampler import microbatch
from engine.spec import TrainSpec
from engine.step import ShardResult, TrainState, evaluate
from engine.step import compute_shard as _compute_shard
from engine.stored import normalize


@dataclass(frozen=True)
class JobModel:
    """A job's spec and model, for its dataset's facts."""

    spec: TrainSpec
    model: Model
    n_train: int
    input_shape: tuple[int, ...]
    num_classes: int


def job_model(spec: dict[str, Any], n_train: int, input_shape: Sequence[int],
              num_classes: int) -> JobModel:
    """The job spec (JSON) read and its model built; SpecError/ValueError name what is wrong."""
    train = TrainSpec.from_job_spec(spec, n_train=int(n_train))
    shape = tuple(int(v) for v in input_shape)
    model = build_model(train.arch, shape, int(num_classes), train.model_options)
    return JobModel(train, model, int(n_train), shape, int(num_classes))


def shard_arrays(npz: bytes | str) -> tuple[np.ndarray, np.ndarray]:
    """A shard's samples as the control plane serves them (an .npz of x and y, no pickle):
    float32, or as stored with the `mean` and `std` to normalize by (engine.stored)."""
    source = io.BytesIO(npz) if isinstance(npz, bytes) else npz
    with np.load(source, allow_pickle=False) as arrays:
        mean = arrays["mean"] if "mean" in arrays.files else None
        std = arrays["std"] if "std" in arrays.files else None
        return normalize(arrays["x"], mean, std), arrays["y"].astype(np.int64)


def shard_gradient(job: JobModel, params: np.ndarray, buffers: np.ndarray, x: np.ndarray,
                   y: np.ndarray, step: int, shard: int, backend: str = "numpy") -> ShardResult:
    """Shard `shard`'s gradient sum at `step`, from all of that shard's samples (x, y): its
    micro-batch is drawn here, seeded by (seed, step, shard), and augmented as the spec asks."""
    spec = job.spec
    pos = microbatch(len(x), spec.per_shard_batch, spec.seed, step, shard, spec.steps_per_epoch)
    xb = augment(x[pos], pos, spec.seed, step, shard, spec.crop_padding, spec.horizontal_flip)
    yb = y[pos]
    return _compute_shard(job.model, params, buffers, xb, yb, spec, step, shard, backend)


def params_digest(state: TrainState) -> str:
    """SHA-256 of the parameter vector's bytes: equal digests are bit-identical weights."""
    return hashlib.sha256(np.ascontiguousarray(state.params).tobytes()).hexdigest()


def final_metrics(job: JobModel, state: TrainState, last_epoch_losses: Sequence[float],
                  last_epoch_accuracies: Sequence[float], x_val: np.ndarray,
                  y_val: np.ndarray, validated: tuple[float, float] | None = None
                  ) -> dict[str, Any]:
    """A finished job's metrics: the last epoch's mean train loss and accuracy, validation on
    the final weights (`val_loss`, `val_accuracy`: only when the dataset has a validation
    split), and the weights' digest. `validated`: (loss, accuracy) the caller already measured
    on these final weights, so the validation set is not run through twice."""
    out: dict[str, Any] = {
        "train_loss": float(np.mean(last_epoch_losses)),
        "train_accuracy": float(np.mean(last_epoch_accuracies)),
        "steps": state.step, "epochs": job.spec.epochs, "n_params": job.model.n_params,
    }
    if validated is not None:
        out.update(val_loss=validated[0], val_accuracy=validated[1])
    elif len(y_val):
        ev = evaluate(job.model, state.params, state.buffers, x_val, y_val,
                      kernels=kernels_for(job.spec.exactness))
        out.update(val_loss=ev.loss, val_accuracy=ev.accuracy)
    out["params_sha256"] = params_digest(state)
    return out
