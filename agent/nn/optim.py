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

import numpy as np

from agent.nn.spec import TrainSpec


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
        p = params[block].astype(np.float64)
        g = grad_mean[block].astype(np.float64)
        if grad_divisor != 1.0:
            g /= grad_divisor
        if weight_decay:
            g += weight_decay * decay_mask[block] * p
        v = momentum * momentum_buf[block].astype(np.float64) + g
        update = g + momentum * v if nesterov else v
        new_params[block] = p - lr * update
        new_momentum[block] = v
    return new_params, new_momentum
