"""Learning-rate schedule and SGD over flat vectors, as pure functions.

lr(t) for the step t being applied (0-based), with spe = steps per epoch and T = total steps:

* base = lr x global_batch_size / 256 when lr_scaling (Goyal et al.'s linear scaling rule),
  else lr;
* warmup (W = warmup_epochs x spe steps): lr(t) = base x (t + 1) / W while t < W;
* then `constant`: base; `cosine`: base x (1 + cos(pi x (t - W) / (T - W))) / 2;
  `step`: base x decay_factor ** (number of decay_epochs <= t / spe).

Update (weight decay only on kernels, not biases or BN): g = grad_mean + wd x mask x p;
v = momentum x v + g; p -= lr x (g + momentum x v if nesterov else v).
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from engine.spec import TrainSpec


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
        return base * spec.decay_factor ** sum(1 for e in spec.decay_epochs if e <= epoch)
    span = max(total - warmup, 1.0)
    progress = min(max((step - warmup) / span, 0.0), 1.0)
    return base * 0.5 * (1.0 + math.cos(math.pi * progress))


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
    """The update of one block, given its float64 gradient sum `g` (modified in place)."""
    p = params[block].astype(np.float64)
    if grad_divisor != 1.0:
        g /= grad_divisor
    if weight_decay:
        g += weight_decay * decay_mask[block] * p
    v = momentum * momentum_buf[block].astype(np.float64) + g
    update = g + momentum * v if nesterov else v
    new_params[block] = p - lr * update
    new_momentum[block] = v


# Elements per block of the fused sum + update: the float64 accumulator (256 KB) and the
# block's temporaries stay in the caches while every shard adds its block.
FUSED_BLOCK = 1 << 15
_POOLS: dict[int, ThreadPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()


def _pool(workers: int) -> ThreadPoolExecutor:
    with _POOLS_LOCK:
        pool = _POOLS.get(workers)
        if pool is None:
            pool = _POOLS[workers] = ThreadPoolExecutor(workers, thread_name_prefix="sgd")
        return pool


def sum_and_update(grads: list[np.ndarray], params: np.ndarray, momentum_buf: np.ndarray,
                   lr: float, momentum: float, weight_decay: float, nesterov: bool,
                   decay_mask: np.ndarray, grad_divisor: float = 1.0, workers: int = 1,
                   out: tuple[np.ndarray, np.ndarray] | None = None,
                   ) -> tuple[np.ndarray, np.ndarray]:
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

    def run(lo: int, hi: int) -> None:
        for start in range(lo, hi, FUSED_BLOCK):
            block = slice(start, min(start + FUSED_BLOCK, hi))
            g = np.zeros(block.stop - block.start, np.float64)
            for a in grads:
                g += a[block]
            _update_block(block, g, params, momentum_buf, new_params, new_momentum, lr,
                          momentum, weight_decay, nesterov, decay_mask, grad_divisor)

    blocks = -(-n // FUSED_BLOCK)
    workers = max(1, min(workers, blocks))
    if workers == 1:
        run(0, n)
        return new_params, new_momentum
    per = -(-blocks // workers) * FUSED_BLOCK
    futures = [_pool(workers).submit(run, lo, min(lo + per, n)) for lo in range(0, n, per)]
    for f in futures:
        f.result()
    return new_params, new_momentum
