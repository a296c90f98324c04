"""Learning-rate schedule and the optimizers (SGD, AdamW, LARS) over flat vectors, as pure
functions.

lr(t) for the step t being applied (0-based), with spe = steps per epoch and T = total steps:

* base = lr x global_batch_size / 256 when lr_scaling (Goyal et al.'s linear scaling rule),
  else lr;
* warmup (W = warmup_epochs x spe steps): lr(t) = base x (t + 1) / W while t < W;
* then `constant`: base; `cosine`: base x (1 + cos(pi x (t - W) / (T - W))) / 2;
  `step`: base x decay_factor ** (number of decay_epochs <= t / spe).

Updates (weight decay only on kernels, not biases or BN: `mask`), g = the mean gradient, all in
float64 from the float32 state, one rounding per step:

* `sgd` (torch.optim.SGD): g += wd x mask x p; v = momentum x v + g;
  p -= lr x (g + momentum x v if nesterov else v). State: v.
* `adamw` (torch.optim.AdamW, decoupled decay): p *= 1 - lr x wd x mask;
  m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2; with t = step + 1,
  p -= (lr / (1 - b1^t)) x m / (sqrt(v) / sqrt(1 - b2^t) + eps). State: m, then v.
* `lars` (You et al. 2017, as NVIDIA apex's LARC without clipping): for each kernel tensor
  (mask 1) d = trust x (g + wd x p) with trust = eta x |p| / (|g| + wd x |p| + eps) (1 when
  |p| or |g| is 0); biases and BN take d = g; then SGD's momentum step on d. State: v.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from engine import portable
from engine.base import Slot
from engine.spec import TrainSpec

OPTIMIZERS = ("sgd", "adamw", "lars")
# the optimizer state's vectors, each n_params long, by name (checkpoints use these names)
STATE_SLOTS = {"sgd": ("momentum",), "adamw": ("exp_avg", "exp_avg_sq"), "lars": ("momentum",)}


@dataclass(frozen=True)
class Hyper:
    """One step's optimizer settings: the spec's, the step's lr and its 1-based number."""

    kind: str
    lr: float
    t: int
    momentum: float = 0.9
    weight_decay: float = 0.0
    nesterov: bool = False
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    trust_coefficient: float = 0.001

    @classmethod
    def of(cls, spec: TrainSpec, step: int) -> Hyper:
        return cls(spec.optimizer, lr_at(spec, step), step + 1, spec.momentum,
                   spec.weight_decay, spec.nesterov, (spec.beta1, spec.beta2), spec.eps,
                   spec.trust_coefficient)


def base_lr(spec: TrainSpec) -> float:
    return spec.lr * spec.global_batch_size / 256.0 if spec.lr_scaling else spec.lr


def lr_at(spec: TrainSpec, step: int) -> float:
    """Learning rate used when applying step `step` (needs spec.n_train)."""
    spe, total = spec.steps_per_epoch, spec.total_steps
    base = base_lr(spec)
    warmup = spec.warmup_epochs * spe
    if step < warmup:
        return base * (step + 1) / warmup
    if spec.schedule == "constant":
        return base
    if spec.schedule == "step":
        epoch = step / spe
        return base * portable.powi(spec.decay_factor,
                                    sum(1 for e in spec.decay_epochs if e <= epoch))
    span = max(total - warmup, 1.0)
    progress = min(max((step - warmup) / span, 0.0), 1.0)
    # the platform's math.cos differs in its last bit between libms: ours is + - x / alone
    return base * 0.5 * (1.0 + portable.cos(math.pi * progress))


# Elements per block: each float64 temporary is 512 KB, so a block's working set stays in the
# caches and every input is read from memory once (whole-vector numpy made ~12 passes over 26 MB
# arrays for mobilenet_v1: memory-bound; 2^12..2^17 measured, 2^16 best: ~31 -> ~14 ms).
# Element-wise, so blocking changes no bit of the result.
SGD_BLOCK = 1 << 16


def sgd_update(params: np.ndarray, momentum_buf: np.ndarray, grad_mean: np.ndarray, lr: float,
               momentum: float, weight_decay: float, nesterov: bool,
               decay_mask: np.ndarray, grad_divisor: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """New (params, momentum) as float32; arithmetic in float64 for one rounding per step.
    The gradient used is grad_mean / grad_divisor (apply_step passes the sum and the count, so
    the mean is never materialised as a separate vector)."""
    n = params.size
    new_params, new_momentum = np.empty(n, np.float32), np.empty(n, np.float32)
    for lo in range(0, n, SGD_BLOCK):
        block = slice(lo, lo + SGD_BLOCK)
        _update_block(block, grad_mean[block].astype(np.float64), params, momentum_buf,
                      new_params, new_momentum, lr, momentum, weight_decay, nesterov,
                      decay_mask, grad_divisor)
    return new_params, new_momentum


def _update_block(block: slice, g: np.ndarray, params: np.ndarray, momentum_buf: np.ndarray,
                  new_params: np.ndarray, new_momentum: np.ndarray, lr: float, momentum: float,
                  weight_decay: float, nesterov: bool, decay_mask: np.ndarray,
                  grad_divisor: float) -> None:
    """The update of one block, given its float64 gradient sum `g` (modified in place).

    The formula's operations in its order and dtypes, each written into this thread's scratch
    (no temporary allocated: the 2-thread apply of a mobilenet_v1 step makes ~400 fewer 512 KB
    arrays). In the formula's terms: p = float64(params); g /= divisor; g += (wd x mask, in
    float32) x p; v = momentum x float64(v) + g; p - lr x (g + momentum x v if nesterov else
    v), rounded to float32 once, as the whole-vector formula (tests/engine/test_optim.py)."""
    p, v, t, t32 = thread_scratch("sgd", g.size, (np.float64,) * 3 + (np.float32,))
    np.copyto(p, params[block])
    if grad_divisor != 1.0:
        g /= grad_divisor
    if weight_decay:
        if t32.dtype == np.result_type(decay_mask, weight_decay):  # a float32 mask, a float
            np.multiply(decay_mask[block], weight_decay, out=t32)
            np.multiply(t32, p, out=t)
        else:  # wider: as the formula's `wd * mask` promotes them
            np.multiply(weight_decay * decay_mask[block], p, out=t)
        g += t
    np.copyto(v, momentum_buf[block])
    v *= momentum
    v += g
    if nesterov:
        np.multiply(v, momentum, out=t)
        t += g
        t *= lr
    else:
        np.multiply(v, lr, out=t)
    p -= t  # in float64, then rounded once (a subtract into float32 casts in small chunks)
    np.copyto(new_params[block], p)
    np.copyto(new_momentum[block], v)


_SCRATCH = threading.local()


def thread_scratch(key: str, size: int, dtypes: Sequence[type]) -> list[np.ndarray]:
    """This thread's working arrays under `key`, one per dtype, of `size` elements each: made
    once a thread and grown when a larger size or more arrays are asked (the blocks of the
    update and the tree's sum are at most FUSED_BLOCK, SGD_BLOCK or engine.step's REDUCE_BLOCK),
    so a block's temporaries are never allocated again. Valid until the thread asks again."""
    have: list[np.ndarray] = getattr(_SCRATCH, key, [])
    if len(have) < len(dtypes) or (have and have[0].size < size):
        width = max(size, have[0].size if have else 0)
        have = [np.empty(width, dtype) for dtype in dtypes]
        setattr(_SCRATCH, key, have)
    return [a[:size] for a in have[:len(dtypes)]]


# Elements per block of the fused sum + update: the float64 accumulator (512 KB) and the
# block's temporaries stay in the caches while every shard adds its block. With the tree's
# sum made inside the pass, fewer blocks mean less Python holding the GIL between numpy's
# loops (the step's apply phase at 8 agents fell from 36-47 to 28-31 ms with this change,
# docs/benchmarks.md "Session 19")
FUSED_BLOCK = 1 << 16
_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _pool(workers: int) -> ThreadPoolExecutor:
    with _POOLS_LOCK:
        pool = _POOLS.get(workers)
        if pool is None:
            pool = _POOLS[workers] = ThreadPoolExecutor(workers, thread_name_prefix="sgd")
        return pool


# Elements per block of `ordered_sum`: a 256 KB float64 accumulator stays in the cache while
# every input adds its block to it, instead of one pass over a 26 MB vector per input (8
# mobilenet_v1 shards: ~39 -> ~25 ms measured; docs/benchmarks.md).
SUM_BLOCK = 1 << 15


def ordered_sum(arrays: Sequence[np.ndarray] | GradBlocks, n: int) -> np.ndarray:
    """float64 sum of `arrays` added in list order, blocked for the cache. Each element still
    starts at 0.0 and gets arrays[0], arrays[1], ... added in turn: bit for bit the plain loop
    `total += a` for a in arrays."""
    grads = _blocks(arrays)
    total = np.zeros(n, dtype=np.float64)
    for lo in range(0, n, SUM_BLOCK):
        block = total[lo:lo + SUM_BLOCK]
        for a in grads(lo, lo + block.size):
            block += a
    return total


# The gradient sum a step adds, read a range at a time: the arrays whose [lo, hi) elements are
# added (in float64, in list order) for that range. engine.step passes the reduction tree's
# sum made range by range, so the tree's additions share the update's pass and its threads.
GradBlocks = Callable[[int, int], Sequence[np.ndarray]]

# Told, on the thread that wrote it, that the new state's elements in a block are final: the
# caller can copy or checksum them while they are in that core's cache (scheduler.apply
# fills and checksums the weights message this way). Blocks come in any order, each once.
BlockDone = Callable[[slice], None]


def as_blocks(grads: Sequence[np.ndarray]) -> GradBlocks:
    """Whole gradient vectors read a range at a time."""
    return lambda lo, hi: [a[lo:hi] for a in grads]


def _fused(grads: GradBlocks, n: int, update_block: Callable[[slice, np.ndarray], None],
           workers: int, done: BlockDone | None = None) -> None:
    """Call update_block(block, g) for every block, g the float64 sum of the grads' block added
    in list order; `workers` threads take contiguous ranges (numpy releases the GIL)."""

    def run(lo: int, hi: int) -> None:
        for start in range(lo, hi, FUSED_BLOCK):
            block = slice(start, min(start + FUSED_BLOCK, hi))
            # the block's sum in this thread's scratch, no zeroed array made a block
            (g,) = thread_scratch("sum", block.stop - block.start, (np.float64,))
            arrays = grads(block.start, block.stop)
            if arrays:  # 0.0 + a, as when added to zeros: a -0.0 becomes +0.0 the same
                np.add(arrays[0], 0.0, out=g)
            else:
                g.fill(0.0)
            for a in arrays[1:]:
                g += a
            update_block(block, g)
            if done is not None:
                done(block)

    blocks = -(-n // FUSED_BLOCK)
    workers = max(1, min(workers, blocks))
    if workers == 1:
        run(0, n)
        return
    per = -(-blocks // workers) * FUSED_BLOCK
    futures = [_pool(workers).submit(run, lo, min(lo + per, n)) for lo in range(0, n, per)]
    for f in futures:
        f.result()


def sum_and_update(grads: Sequence[np.ndarray] | GradBlocks, params: np.ndarray, momentum_buf: np.ndarray,
                   lr: float, momentum: float, weight_decay: float, nesterov: bool,
                   decay_mask: np.ndarray, grad_divisor: float = 1.0, workers: int = 1,
                   out: tuple[np.ndarray, np.ndarray] | None = None,
                   done: BlockDone | None = None) -> tuple[np.ndarray, np.ndarray]:
    """`sgd_update` of the float64 sum of `grads` added in list order, in one pass.

    Bit for bit `sgd_update(params, momentum_buf, ordered_sum(grads), ...)`: every element
    still starts at 0.0, gets grads[0], grads[1], ... added in turn, then the same element-wise
    update. Fusing keeps the 26 MB float64 sum of a mobilenet_v1 out of memory, and because
    nothing crosses elements, `workers` threads can each take a contiguous range (numpy
    releases the GIL inside its loops) without changing a bit. `out`: float32 arrays to write
    the new (params, momentum) into (e.g. views of the messages that carry them on).
    """
    n = params.size
    new_params, new_momentum = out or (np.empty(n, np.float32), np.empty(n, np.float32))
    _fused(_blocks(grads), n, lambda block, g: _update_block(
        block, g, params, momentum_buf, new_params, new_momentum, lr, momentum, weight_decay,
        nesterov, decay_mask, grad_divisor), workers, done)
    return new_params, new_momentum


def optimizer_step(grads: Sequence[np.ndarray] | GradBlocks, params: np.ndarray, opt_state: np.ndarray,
                   hp: Hyper, decay_mask: np.ndarray, slots: Sequence[Slot],
                   grad_divisor: float = 1.0, workers: int = 1,
                   out: tuple[np.ndarray, np.ndarray] | None = None,
                   done: BlockDone | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The new float32 (params, optimizer state) from the float64 sum of `grads` (added in
    list order; vectors, or GradBlocks) divided by `grad_divisor`; `slots`: the parameter
    tensors (LARS scales each). `done`: told of each block once final (BlockDone; LARS,
    which needs whole tensors first, tells of the whole vector at the end)."""
    if hp.kind not in STATE_SLOTS:  # before its state's width is asked of it (a KeyError)
        raise ValueError(f"unknown optimizer {hp.kind!r}; one of {', '.join(OPTIMIZERS)}")
    n = params.size
    width = len(STATE_SLOTS[hp.kind]) * n
    if opt_state.size != width:
        raise ValueError(f"{hp.kind} keeps {width // n} vector(s) of state per parameter; "
                         f"the state holds {opt_state.size / n:g}")
    if hp.kind == "sgd":
        return sum_and_update(grads, params, opt_state, hp.lr, hp.momentum, hp.weight_decay,
                              hp.nesterov, decay_mask, grad_divisor, workers, out, done)
    new_params, new_state = out or (np.empty(n, np.float32), np.empty(width, np.float32))
    if hp.kind == "adamw":
        _fused(_blocks(grads), n, lambda block, g: _adamw_block(
            block, g, params, opt_state, new_params, new_state, hp, decay_mask, grad_divisor),
            workers, done)
    else:  # lars
        _lars(_blocks(grads), params, opt_state, new_params, new_state, hp, decay_mask, slots,
              grad_divisor)
        if done is not None:
            done(slice(0, n))
    return new_params, new_state


def _blocks(grads: Sequence[np.ndarray] | GradBlocks) -> GradBlocks:
    return grads if callable(grads) else as_blocks(grads)


def _adamw_block(block: slice, g: np.ndarray, params: np.ndarray, state: np.ndarray,
                 new_params: np.ndarray, new_state: np.ndarray, hp: Hyper,
                 decay_mask: np.ndarray, grad_divisor: float) -> None:
    n = params.size
    second = slice(n + block.start, n + block.stop)
    p = params[block].astype(np.float64)
    if grad_divisor != 1.0:
        g /= grad_divisor
    if hp.weight_decay:
        p *= 1.0 - hp.lr * hp.weight_decay * decay_mask[block]
    b1, b2 = hp.betas
    m = b1 * state[block].astype(np.float64) + (1.0 - b1) * g
    v = b2 * state[second].astype(np.float64) + (1.0 - b2) * (g * g)
    denom = np.sqrt(v) / math.sqrt(1.0 - portable.powi(b2, hp.t)) + hp.eps
    new_params[block] = p - (hp.lr / (1.0 - portable.powi(b1, hp.t))) * (m / denom)
    new_state[block] = m
    new_state[second] = v


def _lars(grads: GradBlocks, params: np.ndarray, state: np.ndarray,
          new_params: np.ndarray, new_state: np.ndarray, hp: Hyper, decay_mask: np.ndarray,
          slots: Sequence[Slot], grad_divisor: float) -> None:
    """LARS needs each tensor's whole gradient norm before any of it is updated: the sum is
    made first (in list order, as everywhere), then the update, element-wise."""
    n = params.size
    g = ordered_sum(grads, n)
    if grad_divisor != 1.0:
        g /= grad_divisor
    p = params.astype(np.float64)
    d = g + hp.weight_decay * decay_mask * p if hp.weight_decay else g
    for s in slots:
        if not s.decay:
            continue
        part = slice(s.offset, s.offset + s.size)
        # sums in engine.portable's fixed order (BLAS's dot and numpy's SIMD loops vary)
        w_norm = math.sqrt(float(portable.fold(p[part] * p[part])))
        g_norm = math.sqrt(float(portable.fold(g[part] * g[part])))
        if w_norm > 0 and g_norm > 0:
            d[part] *= hp.trust_coefficient * w_norm / (
                g_norm + hp.weight_decay * w_norm + hp.eps)
    v = hp.momentum * state.astype(np.float64) + d
    update = d + hp.momentum * v if hp.nesterov else v
    new_params[:] = p - hp.lr * update
    new_state[:] = v
