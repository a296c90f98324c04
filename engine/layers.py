"""Dense, activations, pooling, dropout, flatten and the loss: forward and backward side by side.

numpy activations are NHWC (see base.py); pooling windows walk kernel offsets as strided slices,
so nothing is gathered with fancy indexing and backward never needs np.add.at.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from engine.base import Builder, Ctx, Layer
from engine.kernels import CLASS, Kernels


class Dense(Layer):
    def __init__(self, units: int, name: str, init: str = "he") -> None:
        self.units, self.name, self.init = units, name, init

    def build(self, in_shape: tuple[int, ...], b: Builder) -> tuple[int, ...]:
        (fan_in,) = in_shape
        self.w = b.param(f"{self.name}.weight", (self.units, fan_in), self.init, fan_in,
                         self.units, decay=True)
        self.b = b.param(f"{self.name}.bias", (self.units,), "zeros")
        return (self.units,)

    def forward(self, x, P, ctx):
        k = ctx.kernels
        y = k.matmul(x, P[self.w].T)
        y += P[self.b]
        return y, (x, k)

    def backward(self, dy, cache, P, G, need_dx=True):
        x, k = cache
        G[self.w][...] = k.matmul(dy.T, x)
        G[self.b][...] = k.colsum(dy)
        return k.matmul(dy, P[self.w]) if need_dx else None

    def torch_forward(self, x, P, ctx):
        import torch.nn.functional as F

        return F.linear(x, P[self.w], P[self.b])


class ReLU(Layer):
    def forward(self, x, P, ctx):
        y = np.maximum(x, 0)
        return y, y

    def backward(self, dy, y, P, G, need_dx=True):
        return dy * (y > 0)

    def torch_forward(self, x, P, ctx):
        import torch

        return torch.relu(x)


class ReLU6(Layer):
    def forward(self, x, P, ctx):
        y = np.clip(x, 0, 6)
        return y, y

    def backward(self, dy, y, P, G, need_dx=True):
        # the gradient passes strictly inside (0, 6), as torch's hardtanh backward does
        inside = y > 0
        inside &= y < 6
        return dy * inside

    def torch_forward(self, x, P, ctx):
        import torch.nn.functional as F

        return F.relu6(x)


def _windows(h: int, w: int, k: int, s: int) -> tuple[int, int]:
    return (h - k) // s + 1, (w - k) // s + 1


def _pad_hw(x: np.ndarray, p: int, value: float) -> np.ndarray:
    if p == 0:
        return x
    n, h, w, c = x.shape
    xp = np.full((n, h + 2 * p, w + 2 * p, c), value, dtype=x.dtype)
    xp[:, p : p + h, p : p + w, :] = x
    return xp


class MaxPool(Layer):
    """k x k max pooling with stride s (floor mode) over an input padded by p with -inf (as
    torch pads); ties go to the first element in scan order."""

    def __init__(self, k: int = 2, s: int | None = None, pad: int = 0) -> None:
        self.k, self.s, self.p = k, s or k, pad

    def build(self, in_shape, b):
        c, h, w = in_shape
        ho, wo = _windows(h + 2 * self.p, w + 2 * self.p, self.k, self.s)
        return (c, ho, wo)

    def _slices(self, ho: int, wo: int):
        k, s = self.k, self.s
        for i in range(k):
            for j in range(k):
                yield np.s_[:, i : i + s * (ho - 1) + 1 : s, j : j + s * (wo - 1) + 1 : s, :]

    def _unpad(self, dxp: np.ndarray) -> np.ndarray:
        p = self.p
        return np.ascontiguousarray(dxp[:, p:-p, p:-p, :]) if p else dxp

    def forward(self, x, P, ctx):
        x = _pad_hw(x, self.p, -np.inf)
        ho, wo = _windows(x.shape[1], x.shape[2], self.k, self.s)
        y = None
        for sl in self._slices(ho, wo):
            y = x[sl].copy() if y is None else np.maximum(y, x[sl], out=y)
        return y, (x, y)

    def backward(self, dy, cache, P, G, need_dx=True):
        x, y = cache
        dx = np.zeros_like(x)
        taken = np.zeros(y.shape, dtype=bool)
        for sl in self._slices(y.shape[1], y.shape[2]):
            first = (x[sl] == y) & ~taken
            dx[sl] += dy * first
            taken |= first
        return self._unpad(dx)

    def torch_forward(self, x, P, ctx):
        import torch.nn.functional as F

        return F.max_pool2d(x, self.k, self.s, self.p)


class AvgPool(MaxPool):
    """k x k average pooling; padding counts as zeros in the average (torch's default,
    count_include_pad=True)."""

    def forward(self, x, P, ctx):
        x = _pad_hw(x, self.p, 0.0)
        ho, wo = _windows(x.shape[1], x.shape[2], self.k, self.s)
        y = np.zeros((x.shape[0], ho, wo, x.shape[3]), dtype=x.dtype)
        for sl in self._slices(ho, wo):
            y += x[sl]
        return y * (1.0 / self.k**2), x.shape

    def backward(self, dy, shape, P, G, need_dx=True):
        dx = np.zeros(shape, dtype=dy.dtype)
        part = dy * (1.0 / self.k**2)
        for sl in self._slices(dy.shape[1], dy.shape[2]):
            dx[sl] += part
        return self._unpad(dx)

    def torch_forward(self, x, P, ctx):
        import torch.nn.functional as F

        return F.avg_pool2d(x, self.k, self.s, self.p)


class GlobalAvgPool(Layer):
    def build(self, in_shape, b):
        return (in_shape[0],)

    def forward(self, x, P, ctx):
        n, h, w, c = x.shape
        total = ctx.kernels.sum_axis(x.reshape(n, h * w, c), 1)
        return total / np.asarray(h * w, dtype=x.dtype), x.shape

    def backward(self, dy, shape, P, G, need_dx=True):
        n, h, w, c = shape
        return np.broadcast_to((dy / (h * w))[:, None, None, :], shape).copy()

    def torch_forward(self, x, P, ctx):
        return x.mean(dim=(2, 3))


class Flatten(Layer):
    """To (N, C*H*W) in canonical NCHW order, so a dense weight means the same in torch."""

    def build(self, in_shape, b):
        return (math.prod(in_shape),)

    def forward(self, x, P, ctx):
        if x.ndim == 2:
            return x, x.shape
        return x.transpose(0, 3, 1, 2).reshape(x.shape[0], -1), x.shape

    def backward(self, dy, shape, P, G, need_dx=True):
        if len(shape) == 2:
            return dy
        n, h, w, c = shape
        return np.ascontiguousarray(dy.reshape(n, c, h, w).transpose(0, 2, 3, 1))

    def torch_forward(self, x, P, ctx):
        return x.reshape(x.shape[0], -1)


class Dropout(Layer):
    """Inverted dropout; the mask is a pure function of (seed, step, shard, layer index)."""

    def __init__(self, p: float) -> None:
        self.p = p

    def build(self, in_shape, b):
        self.index = b.next_index()
        return in_shape

    def mask(self, canonical_shape: tuple[int, ...], ctx: Ctx, dtype: Any) -> np.ndarray:
        keep = ctx.rng(self.index).random(canonical_shape, dtype=np.float64) >= self.p
        return keep.astype(dtype) * (1.0 / (1.0 - self.p))

    def forward(self, x, P, ctx):
        if not ctx.training or self.p == 0:
            return x, None
        canon = (x.shape[0], x.shape[3], x.shape[1], x.shape[2]) if x.ndim == 4 else x.shape
        m = self.mask(canon, ctx, x.dtype)
        m = m.transpose(0, 2, 3, 1) if x.ndim == 4 else m
        return x * m, m

    def backward(self, dy, m, P, G, need_dx=True):
        return dy if m is None else dy * m

    def torch_forward(self, x, P, ctx):
        import torch

        if not ctx.training or self.p == 0:
            return x
        m = self.mask(tuple(x.shape), ctx, np.float64)
        return x * torch.from_numpy(m).to(x.dtype)


def softmax_cross_entropy(logits: np.ndarray, y: np.ndarray, smoothing: float = 0.0,
                          kernels: Kernels = CLASS) -> tuple[float, int, np.ndarray]:
    """Summed loss, correct count and d(loss_sum)/d(logits). With label smoothing e (torch's
    `label_smoothing`), the target is (1 - e) on the label plus e / K on every class."""
    z = logits - logits.max(axis=1, keepdims=True)
    e = kernels.exp(z)
    total = kernels.sum_axis(e, 1)[:, None]
    rows = np.arange(len(y))
    log_total = kernels.log(total[:, 0])
    logp = z[rows, y] - log_total
    grad = e / total
    if smoothing:
        k = logits.shape[1]
        mean_logp = kernels.sum_axis(z, 1) / np.asarray(k, z.dtype) - log_total
        loss = -kernels.total((1.0 - smoothing) * logp.astype(np.float64)
                              + smoothing * mean_logp.astype(np.float64))
        grad -= smoothing / k
        grad[rows, y] -= 1.0 - smoothing
    else:
        loss = -kernels.total(logp.astype(np.float64))
        grad[rows, y] -= 1
    correct = int((logits.argmax(axis=1) == y).sum())
    return float(loss), correct, grad
