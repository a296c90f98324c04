"""One training step, split where the cluster splits it.

`compute_shard` runs on a phone (or in the reference trainer) for one shard's micro-batch;
`apply_step` runs once per step wherever the step is applied. The reference trainer and the
scheduler both call `apply_step`, and it sorts the shards' results and adds them in float64 in
shard order, so which device computed which shard cannot change the step.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from engine.graph import Model
from engine.optim import STATE_SLOTS, Hyper, optimizer_step, ordered_sum
from engine.precision import round_to
from engine.spec import TrainSpec

BN_MOMENTUM = 0.1  # running = (1 - 0.1) x running + 0.1 x (shard-averaged batch statistic)
BACKENDS = ("numpy", "torch")


@dataclass
class ShardResult:
    shard: int
    grad_sum: np.ndarray  # d(sum of the micro-batch's losses)/d(params), float32[n_params]
    loss_sum: float
    correct: int
    count: int
    stats: np.ndarray  # the micro-batch's BN means and unbiased variances, float32[n_stats]


@dataclass
class TrainState:
    step: int
    params: np.ndarray
    opt_state: np.ndarray  # the optimizer's vectors, each n_params long (optim.STATE_SLOTS)
    buffers: np.ndarray


@dataclass(frozen=True)
class StepMetrics:
    step: int  # the step that was applied
    train_loss: float
    train_accuracy: float
    lr: float
    samples: int


@dataclass(frozen=True)
class EvalMetrics:
    loss: float
    accuracy: float
    count: int


def compute_shard(model: Model, params: np.ndarray, buffers: np.ndarray, x_shard: np.ndarray,
                  y_shard: np.ndarray, spec: TrainSpec, step: int, shard: int,
                  backend: str = "numpy") -> ShardResult:
    """Gradient sum of shard `shard` at `step`. x_shard/y_shard: this step's micro-batch
    (`sampler.select_microbatch` picks it out of the shard's data)."""
    if backend == "numpy":
        r = model.loss_and_grad(params, buffers, x_shard, y_shard, spec.seed, step, shard,
                                spec.label_smoothing)
    elif backend == "torch":
        from engine import torch_backend

        r = torch_backend.loss_and_grad(model, params, buffers, x_shard, y_shard, spec.seed,
                                        step, shard, spec.label_smoothing)
    else:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    # rounded here, where every compute path passes: the sum is of the values the wire carries
    grad = round_to(r.grad_sum.astype(np.float32, copy=False), spec.upload_precision)
    return ShardResult(shard, grad, r.loss_sum, r.correct, r.count,
                       r.stats.astype(np.float32, copy=False))


def initial_state(model: Model, spec: TrainSpec) -> TrainState:
    params, buffers = model.init(spec.seed)
    slots = len(STATE_SLOTS[spec.optimizer])
    return TrainState(0, params, np.zeros(slots * params.size, np.float32), buffers)


def apply_step(model: Model, spec: TrainSpec, state: TrainState,
               results: Iterable[ShardResult], workers: int = 1,
               out: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
               ) -> tuple[TrainState, StepMetrics]:
    """Average every shard's gradient for state.step, update, and return step + 1.
    `workers` threads share the (element-wise) work; the result is the same bit for bit.
    `out`: float32 (params, optimizer state, buffers) arrays the new state is written into."""
    ordered = _check_results(model, spec, list(results))
    # shard order: the one summation order every placement shares
    stats = ordered_sum([r.stats for r in ordered], model.n_stats)
    loss = 0.0
    correct = count = 0
    for r in ordered:
        loss += r.loss_sum
        correct += r.correct
        count += r.count
    hp = Hyper.of(spec, state.step)
    params, opt_state = optimizer_step([r.grad_sum for r in ordered], state.params,
                                       state.opt_state, hp, model.decay_mask,
                                       list(model.layout.values()), grad_divisor=count,
                                       workers=workers, out=out[:2] if out else None)
    buffers = state.buffers
    if model.n_buffers:
        mean_stats = stats / len(ordered)
        buffers = ((1.0 - BN_MOMENTUM) * state.buffers.astype(np.float64)
                   + BN_MOMENTUM * mean_stats).astype(np.float32)
    if out is not None:
        out[2][:] = buffers
        buffers = out[2]
    metrics = StepMetrics(state.step, loss / count, correct / count, hp.lr, count)
    return TrainState(state.step + 1, params, opt_state, buffers), metrics


def _check_results(model: Model, spec: TrainSpec, results: list[ShardResult]) -> list[ShardResult]:
    ordered = sorted(results, key=lambda r: r.shard)
    shards = [r.shard for r in ordered]
    if shards != list(range(spec.shards)):
        missing = sorted(set(range(spec.shards)) - set(shards))
        extra = sorted({k for k in shards if shards.count(k) > 1 or not 0 <= k < spec.shards})
        raise ValueError(f"step needs each of shards 0..{spec.shards - 1} exactly once; "
                         f"missing {missing}, duplicated or unknown {extra}")
    for r in ordered:
        if r.grad_sum.shape != (model.n_params,) or r.stats.shape != (model.n_stats,):
            raise ValueError(f"shard {r.shard}: result does not fit this model's layout")
        if r.count != spec.per_shard_batch:
            raise ValueError(f"shard {r.shard}: {r.count} samples, expected "
                             f"{spec.per_shard_batch}")
    return ordered


# What evaluation may hold at once: a batch's biggest layer output and its input, in float32
# (a 224x224 resnet50 takes ~8 images a batch, the digits cnn its full 512)
EVAL_BYTES = 256 << 20


def evaluate(model: Model, params: np.ndarray, buffers: np.ndarray, x: np.ndarray,
             y: np.ndarray, batch_size: int = 512) -> EvalMetrics:
    """Mean loss and accuracy in evaluation mode (running BN statistics, no dropout); batches
    sized so the biggest layer output stays under EVAL_BYTES (the sums do not depend on it)."""
    from engine.layers import softmax_cross_entropy

    batch_size = max(1, min(batch_size, EVAL_BYTES // (8 * max(model.largest_activation, 1))))

    loss, correct = 0.0, 0
    for start in range(0, len(y), batch_size):
        logits = model.logits(params, buffers, x[start : start + batch_size])
        batch_loss, batch_correct, _ = softmax_cross_entropy(logits, y[start : start + batch_size])
        loss += batch_loss
        correct += batch_correct
    n = max(len(y), 1)
    return EvalMetrics(loss / n, correct / n, len(y))
