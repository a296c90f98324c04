"""Containers (sequence, residual block) and the Model: layout, init, loss and gradient."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine import portable
from engine.base import Builder, Ctx, Layer, Slot, to_nhwc
from engine.kernels import CLASS, Kernels
from engine.layers import softmax_cross_entropy

_INIT_TAG = 0x1417


class Sequential(Layer):
    def __init__(self, layers: list[Layer]) -> None:
        self.layers = layers

    def build(self, in_shape, b):
        for layer in self.layers:
            in_shape = layer.build(in_shape, b)
            b.largest_activation = max(b.largest_activation, math.prod(in_shape))
        return in_shape

    def forward(self, x, P, ctx):
        caches = []
        for layer in self.layers:
            x, cache = layer.forward(x, P, ctx)
            caches.append(cache if ctx.training else None)  # evaluation has no backward
        return x, caches

    def backward(self, dy, caches, P, G, need_dx=True):
        for i in range(len(self.layers) - 1, -1, -1):
            dy = self.layers[i].backward(dy, caches[i], P, G, need_dx or i > 0)
        return dy

    def torch_forward(self, x, P, ctx):
        for layer in self.layers:
            x = layer.torch_forward(x, P, ctx)
        return x


class Residual(Layer):
    """y = body(x) + shortcut(x); an empty shortcut is the identity."""

    def __init__(self, body: list[Layer], shortcut: list[Layer] | None = None) -> None:
        self.body, self.short = Sequential(body), Sequential(shortcut or [])

    def build(self, in_shape, b):
        out = self.body.build(in_shape, b)
        short = self.short.build(in_shape, b)
        if out != short:
            raise ValueError(f"residual branches disagree: {out} vs {short}")
        return out

    def forward(self, x, P, ctx):
        yb, cb = self.body.forward(x, P, ctx)
        ys, cs = self.short.forward(x, P, ctx)
        return yb + ys, (cb, cs)

    def backward(self, dy, cache, P, G, need_dx=True):
        dxb = self.body.backward(dy, cache[0], P, G, need_dx)
        dxs = self.short.backward(dy, cache[1], P, G, need_dx)
        return dxb + dxs if need_dx else None

    def torch_forward(self, x, P, ctx):
        return self.body.torch_forward(x, P, ctx) + self.short.torch_forward(x, P, ctx)


@dataclass
class LossGrad:
    grad_sum: np.ndarray
    loss_sum: float
    correct: int
    count: int
    stats: np.ndarray


# A model the cluster will train: every phone holds its parameters, gradients and momentum
# (12 bytes each) and the server a float64 sum. 200 M parameters (VGG-16 has 138 M, ResNet-50
# 25.6 M) is 2.4 GB on a phone; past it a spec is refused before anything is allocated.
MAX_PARAMS = 200_000_000


class ModelTooLarge(ValueError):
    """More parameters than MAX_PARAMS: refused before any array is allocated."""


def plan_layout(arch: str, input_shape: tuple[int, ...], num_classes: int,
                net: Sequential) -> Builder:
    """The network's slots (no arrays allocated); ModelTooLarge past MAX_PARAMS."""
    b = Builder()
    out = net.build(tuple(input_shape), b)
    if out != (num_classes,):
        raise ValueError(f"{arch} ends in shape {out}, expected ({num_classes},)")
    n_params = sum(s.size for s in b.params)
    if n_params > MAX_PARAMS:
        raise ModelTooLarge(f"{arch} on inputs {tuple(input_shape)} with {num_classes:,} classes "
                            f"has {n_params:,} parameters; the limit is {MAX_PARAMS:,}")
    return b


class Model:
    """A built network: named layouts of params, buffers and stats, and its maths."""

    def __init__(self, arch: str, input_shape: tuple[int, int, int], num_classes: int,
                 net: Sequential) -> None:
        self.arch, self.input_shape, self.num_classes, self.net = (
            arch, tuple(input_shape), num_classes, net)
        b = plan_layout(arch, self.input_shape, num_classes, net)
        self.layout: dict[str, Slot] = {s.name: s for s in b.params}
        self.buffer_layout: dict[str, Slot] = {s.name: s for s in b.buffers}
        self.stats_layout: dict[str, Slot] = {s.name: s for s in b.stats}
        self.n_params = sum(s.size for s in b.params)
        self.n_buffers = sum(s.size for s in b.buffers)
        self.n_stats = sum(s.size for s in b.stats)
        self.largest_activation = b.largest_activation
        self.decay_mask = np.zeros(self.n_params, dtype=np.float32)
        for s in b.params:
            if s.decay:
                self.decay_mask[s.offset : s.offset + s.size] = 1.0

    def init(self, seed: int) -> tuple[np.ndarray, np.ndarray]:
        """He-normal kernels (Glorot-uniform for the classifier), zero biases, BN at 1/0."""
        params = np.zeros(self.n_params, dtype=np.float32)
        for i, s in enumerate(self.layout.values()):
            rng = np.random.default_rng(np.random.SeedSequence([seed, _INIT_TAG, i]))
            params[s.offset : s.offset + s.size] = _init_values(s, rng).ravel()
        buffers = np.zeros(self.n_buffers, dtype=np.float32)
        for s in self.buffer_layout.values():
            buffers[s.offset : s.offset + s.size] = 1.0 if s.init == "ones" else 0.0
        return params, buffers

    def named(self, flat: Any, which: str = "params") -> dict[str, Any]:
        layout = {"params": self.layout, "buffers": self.buffer_layout,
                  "stats": self.stats_layout}[which]
        return {name: s.view(flat) for name, s in layout.items()}

    def loss_and_grad(self, params: np.ndarray, buffers: np.ndarray, x: np.ndarray,
                      y: np.ndarray, seed: int = 0, step: int = 0, shard: int = 0,
                      label_smoothing: float = 0.0, kernels: Kernels = CLASS) -> LossGrad:
        """Summed loss over the micro-batch x (NCHW) and its gradient (numpy backend), its
        products and sums made by `kernels` (engine.kernels)."""
        ctx = Ctx(True, seed, step, shard, self.named(buffers, "buffers"), kernels=kernels)
        P = self.named(params)
        logits, caches = self.net.forward(to_nhwc(x.astype(params.dtype, copy=False)), P, ctx)
        loss_sum, correct, dlogits = softmax_cross_entropy(logits, y, label_smoothing, kernels)
        grad = np.zeros_like(params)
        self.net.backward(dlogits, caches, P, self.named(grad), need_dx=False)
        return LossGrad(grad, loss_sum, correct, len(y), self._stats_vector(ctx, params.dtype))

    def logits(self, params: np.ndarray, buffers: np.ndarray, x: np.ndarray,
               kernels: Kernels = CLASS) -> np.ndarray:
        """Evaluation-mode forward: running BN statistics, no dropout."""
        ctx = Ctx(False, buffers=self.named(buffers, "buffers"), kernels=kernels)
        out, _ = self.net.forward(to_nhwc(x.astype(params.dtype, copy=False)),
                                  self.named(params), ctx)
        return out

    def _stats_vector(self, ctx: Ctx, dtype: Any) -> np.ndarray:
        stats = np.zeros(self.n_stats, dtype=dtype)
        for name, s in self.stats_layout.items():
            stats[s.offset : s.offset + s.size] = np.asarray(ctx.stats[name]).ravel()
        return stats


def _init_values(s: Slot, rng: np.random.Generator) -> np.ndarray:
    if s.init == "he":  # engine.portable's normal draws: the same on every machine
        return portable.normal(rng, s.shape) * np.sqrt(2.0 / s.fan_in)
    if s.init == "glorot":
        limit = np.sqrt(6.0 / (s.fan_in + s.fan_out))
        return rng.uniform(-limit, limit, s.shape)
    if s.init == "ones":
        return np.ones(s.shape)
    return np.zeros(s.shape)
