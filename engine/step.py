"""One training step, split where the cluster splits it.

`compute_shard` runs on a phone (or in the reference trainer) for one shard's micro-batch;
`reduce_results` adds shard results along the canonical tree (engine.tree), on a phone over
the shards it holds or wherever the step is applied; `apply_step` runs once per step. The
reference trainer and the scheduler both call `apply_step`, which adds whatever partials it is
given up the same tree, so which device computed (or pre-added) which shard cannot change the
step.

A node's value is its two children added in float32 and rounded to `node_precision` (the
job's upload precision, except float16: engine.precision). A float32 add of two float32 (or
narrower) values is their exact sum rounded once, so each level of the tree costs one rounding
at most: 2^-24 (~6e-8) of a node's size in float32; in bfloat16 2^-8 (~4e-3) a level, the price
of a partial of many shards travelling in half the bytes (measured in docs/benchmarks.md).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from engine import tree
from engine.graph import Model
from engine.kernels import CLASS, Kernels, kernels_for
from engine.layers import softmax_cross_entropy
from engine.optim import STATE_SLOTS, BlockDone, Hyper, optimizer_step, thread_scratch
from engine.precision import can_pre_add, node_precision, round_to
from engine.slices import Bounds, slots_within
from engine.spec import TrainSpec

BN_MOMENTUM = 0.1  # running = (1 - 0.1) x running + 0.1 x (shard-averaged batch statistic)
BACKENDS = ("numpy", "torch")


@dataclass
class ShardResult:
    """One shard's result, or (span > 1) a partial: the sum of shards shard..shard+span-1
    along the canonical tree, [shard, shard + span) being a node of it."""

    shard: int
    grad_sum: np.ndarray  # d(sum of the micro-batch's losses)/d(params), float32[n_params]
    loss_sum: float
    correct: int
    count: int
    stats: np.ndarray  # the micro-batch's BN means and unbiased variances, float32[n_stats]
    span: int = 1

    @property
    def node(self) -> tree.Node:
        return (self.shard, self.shard + self.span)


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
    (`sampler.select_microbatch` picks it out of the shard's data). A `portable` job's shard
    is computed with numpy's portable kernels whatever `backend` says (torch's bits, like
    BLAS's, depend on the CPU: engine.kernels)."""
    if backend == "numpy" or spec.exactness == "portable":
        r = model.loss_and_grad(params, buffers, x_shard, y_shard, spec.seed, step, shard,
                                spec.label_smoothing, kernels_for(spec.exactness))
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
               part: Bounds | None = None,
               done: BlockDone | None = None) -> tuple[TrainState, StepMetrics]:
    """Average every shard's gradient for state.step, update, and return step + 1.
    `workers` threads share the (element-wise) work; the result is the same bit for bit.
    `out`: float32 (params, optimizer state, buffers) arrays the new state is written into.
    `done`: told of each block of the new params and optimizer state once final (BlockDone;
    with `part`, blocks of the part's own vector, from 0).
    `part`: apply only the slice [lo, hi) of the vector (engine.slices): `state` is that
    slice's (`cut_state`) and the results' gradients are their [lo, hi) ranges; the slice
    starting at 0 carries the buffers. The slices' states joined are the whole step's."""
    lo, hi = part or (0, model.n_params)
    chosen = _check_results(model, spec, list(results), hi - lo)
    # the canonical tree: the one summation order every placement (and pre-adding) shares;
    # its gradient is added a range at a time inside the update's pass (and threads)
    by_node = {r.node: r for r in chosen}
    loss, correct, count, stats = _tree_scalars(by_node, 0, spec.shards)
    grad = _tree_grad(by_node, 0, spec.shards, spec.upload_precision)
    hp = Hyper.of(spec, state.step)
    slots = list(model.layout.values()) if part is None else slots_within(
        list(model.layout.values()), lo, hi)
    params, opt_state = optimizer_step(lambda a, b: [grad(a, b)], state.params,
                                       state.opt_state, hp, model.decay_mask[lo:hi], slots,
                                       grad_divisor=count, workers=workers,
                                       out=out[:2] if out else None, done=done)
    buffers = state.buffers
    if model.n_buffers and lo == 0:
        mean_stats = stats.astype(np.float64) / spec.shards
        buffers = ((1.0 - BN_MOMENTUM) * state.buffers.astype(np.float64)
                   + BN_MOMENTUM * mean_stats).astype(np.float32)
    if out is not None:
        out[2][:] = buffers
        buffers = out[2]
    metrics = StepMetrics(state.step, loss / count, correct / count, hp.lr, count)
    return TrainState(state.step + 1, params, opt_state, buffers), metrics


def cut_state(state: TrainState, part: Bounds) -> TrainState:
    """Slice [lo, hi)'s share of a state: its params, each optimizer vector's [lo, hi) one
    after another, and the buffers when the slice starts at 0 (else none)."""
    lo, hi = part
    n = state.params.size
    slots = state.opt_state.size // max(n, 1)
    opt = np.concatenate([state.opt_state[k * n + lo : k * n + hi] for k in range(slots)]) \
        if slots else np.zeros(0, np.float32)
    buffers = state.buffers if lo == 0 else np.zeros(0, np.float32)
    return TrainState(state.step, state.params[lo:hi], opt, buffers)


def join_states(parts: Sequence[TrainState], bounds: Sequence[Bounds]) -> TrainState:
    """The whole state from its slices' (`cut_state`'s inverse)."""
    n = bounds[-1][1]
    slots = sum(p.opt_state.size for p in parts) // max(n, 1)
    params = np.empty(n, np.float32)
    opt = np.empty(slots * n, np.float32)
    for p, (lo, hi) in zip(parts, bounds):
        params[lo:hi] = p.params
        for k in range(slots):
            opt[k * n + lo : k * n + hi] = p.opt_state[k * (hi - lo) : (k + 1) * (hi - lo)]
    steps = {p.step for p in parts}
    if len(steps) != 1:
        raise ValueError(f"slices of different steps: {sorted(steps)}")
    return TrainState(steps.pop(), params, opt, parts[0].buffers)


# Elements per block of the tree's sum: every node's block of a few hundred KB stays in the
# cache, and the sum of a 25 M-parameter model never holds more than its result in memory
REDUCE_BLOCK = 1 << 16


def reduce_results(results: Sequence[ShardResult], lo: int, hi: int,
                   precision: str) -> ShardResult:
    """Node [lo, hi)'s partial from results whose nodes cover it exactly once (none above it)
    for a job uploading in `precision`: gradients and statistics added up the tree in float32
    (each node rounded to node_precision), losses in float64 up the same tree, counts summed."""
    by_node = {r.node: r for r in results}
    if (lo, hi) in by_node:
        return by_node[(lo, hi)]
    grad_of = _tree_grad(by_node, lo, hi, precision)
    n = next(iter(by_node.values())).grad_sum.size
    grad = np.empty(n, np.float32)
    for start in range(0, n, REDUCE_BLOCK):
        grad[start:start + REDUCE_BLOCK] = grad_of(start, min(start + REDUCE_BLOCK, n))
    loss, correct, count, stats = _tree_scalars(by_node, lo, hi)
    return ShardResult(lo, grad, loss, correct, count, stats, hi - lo)


def _tree_grad(by_node: dict[tree.Node, ShardResult], lo: int, hi: int,
               precision: str) -> Callable[[int, int], np.ndarray]:
    """Elements [a, b) of node [lo, hi)'s gradient, added up the tree from `by_node` (a cover
    of it): element-wise, so a range at a time gives the whole vector's bits. The tree's
    additions are laid out once (tree.plan) and written into this thread's scratch: the array
    returned is valid until the thread's next call (its callers add or copy it at once)."""
    rounding = node_precision(precision)
    how = tree.plan(by_node.keys(), lo, hi)
    given = [by_node[node].grad_sum for node in how.given]

    def grad(a: int, b: int) -> np.ndarray:
        values = [g[a:b] for g in given]
        if how.root >= 0:
            return values[how.root]
        slots = thread_scratch("tree", b - a, (np.float32,) * how.slots)
        for left, right, out in how.adds:
            np.add(values[left] if left >= 0 else slots[~left],
                   values[right] if right >= 0 else slots[~right],
                   out=slots[out], dtype=np.float32)
            if rounding != "float32":
                slots[out][...] = round_to(slots[out], rounding)
        return slots[~how.root]

    return grad


def _tree_scalars(by_node: dict[tree.Node, ShardResult], lo: int,
                  hi: int) -> tuple[float, int, int, np.ndarray]:
    """Node [lo, hi)'s (loss sum, correct, count, statistics) up the tree: losses in float64,
    statistics in float32."""
    stats = tree.reduce({n: r.stats for n, r in by_node.items()}, lo, hi,
                        lambda a, b: np.add(a, b, dtype=np.float32))
    loss, correct, count = (tree.reduce({n: value(r) for n, r in by_node.items()}, lo, hi,
                                        operator.add)
                            for value in (lambda r: float(r.loss_sum), lambda r: int(r.correct),
                                          lambda r: int(r.count)))
    return loss, correct, count, np.asarray(stats, np.float32)


def pre_reduce(results: Sequence[ShardResult], shards: int, precision: str) -> list[ShardResult]:
    """What a phone uploads for the shard results it computed: one partial per largest node
    they fill (tree.cover), in shard order; the results as they are where the job's precision
    allows no partials (engine.precision.can_pre_add)."""
    if not can_pre_add(precision):
        return sorted(results, key=lambda r: r.shard)
    held = {k for r in results for k in range(*r.node)}
    return [reduce_results([r for r in results if lo <= r.shard < hi], lo, hi, precision)
            for lo, hi in tree.cover(held, shards)]


def _check_results(model: Model, spec: TrainSpec, results: list[ShardResult],
                   width: int) -> list[ShardResult]:
    """The results to add: nodes of the tree covering every shard once (of two covering the
    same shards, the larger: equal bits). Refused: a range that is no node, a shard no result
    covers, arrays or counts that do not fit."""
    by_node: dict[tree.Node, ShardResult] = {}
    for r in results:
        if not tree.is_node(*r.node, spec.shards):
            raise ValueError(f"shards {r.shard}..{r.shard + r.span - 1} are not a node of the "
                             f"reduction tree over {spec.shards} shards")
        by_node.setdefault(r.node, r)
    chosen = tree.choose(by_node, spec.shards)
    if chosen is None:
        covered = {k for lo, hi in by_node for k in range(lo, hi)}
        missing = sorted(set(range(spec.shards)) - covered)
        raise ValueError(f"step needs every one of shards 0..{spec.shards - 1}; missing {missing}")
    picked = [by_node[n] for n in chosen]
    for r in picked:  # width: the gradient's length (a slice's when applying one)
        if r.grad_sum.shape != (width,) or r.stats.shape != (model.n_stats,):
            raise ValueError(f"shard {r.shard}: result does not fit this model's layout")
        if r.count != r.span * spec.per_shard_batch:
            raise ValueError(f"shard {r.shard}: {r.count} samples, expected "
                             f"{r.span * spec.per_shard_batch}")
    return picked


# What evaluation may hold at once: a batch's biggest layer output and its input, in float32
# (a 224x224 resnet50 takes ~8 images a batch, the digits cnn its full 512)
EVAL_BYTES = 256 << 20


def evaluate(model: Model, params: np.ndarray, buffers: np.ndarray, x: np.ndarray,
             y: np.ndarray, batch_size: int = 512, kernels: Kernels = CLASS) -> EvalMetrics:
    """Mean loss and accuracy in evaluation mode (running BN statistics, no dropout); batches
    sized so the biggest layer output stays under EVAL_BYTES (the sums do not depend on it)."""
    batch_size = max(1, min(batch_size, EVAL_BYTES // (8 * max(model.largest_activation, 1))))

    loss, correct = 0.0, 0
    for start in range(0, len(y), batch_size):
        logits = model.logits(params, buffers, x[start : start + batch_size], kernels)
        batch_loss, batch_correct, _ = softmax_cross_entropy(logits, y[start : start + batch_size],
                                                             kernels=kernels)
        loss += batch_loss
        correct += batch_correct
    n = max(len(y), 1)
    return EvalMetrics(loss / n, correct / n, len(y))
