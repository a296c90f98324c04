"""2-D convolution (im2col + one GEMM) and depthwise convolution, NHWC inside.

Conv2d: the padded input's k x k windows are one `as_strided` view, copied once into a
(N*Ho*Wo, k*k*C) matrix; forward is one GEMM against the (k*k*C, Cout) kernel, and backward is
two GEMMs (weights, columns). col2im loops over the k*k kernel offsets and adds a strided slice
each, so it never needs np.add.at. A 1x1 stride-1 conv (MobileNet's pointwise layers) is a
plain GEMM on the activation itself, no copy at all.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import as_strided

from agent.nn.base import Builder, Layer


def _out(size: int, k: int, s: int, p: int) -> int:
    return (size + 2 * p - k) // s + 1


def _pad(x: np.ndarray, p: int) -> np.ndarray:
    if p == 0:
        return x
    n, h, w, c = x.shape
    xp = np.zeros((n, h + 2 * p, w + 2 * p, c), dtype=x.dtype)
    xp[:, p : p + h, p : p + w, :] = x
    return xp


def _offsets(k: int, s: int, ho: int, wo: int):
    for i in range(k):
        for j in range(k):
            yield i, j, np.s_[:, i : i + s * (ho - 1) + 1 : s, j : j + s * (wo - 1) + 1 : s, :]


def im2col(xp: np.ndarray, k: int, s: int, ho: int, wo: int) -> np.ndarray:
    """(N*Ho*Wo, k*k*C) windows of a padded NHWC array, column order (ki, kj, c)."""
    n, _, _, c = xp.shape
    sn, sh, sw, sc = xp.strides
    win = as_strided(xp, (n, ho, wo, k, k, c), (sn, sh * s, sw * s, sh, sw, sc), writeable=False)
    return np.ascontiguousarray(win).reshape(n * ho * wo, k * k * c)


class Conv2d(Layer):
    def __init__(self, cout: int, k: int, name: str, stride: int = 1, pad: int | None = None,
                 bias: bool = True) -> None:
        self.cout, self.k, self.name, self.s = cout, k, name, stride
        self.p = k // 2 if pad is None else pad
        self.bias = bias

    def build(self, in_shape: tuple[int, ...], b: Builder) -> tuple[int, ...]:
        c, h, w = in_shape
        fan_in, fan_out = c * self.k * self.k, self.cout * self.k * self.k
        self.w = b.param(f"{self.name}.weight", (self.cout, c, self.k, self.k), "he", fan_in,
                         fan_out, decay=True)
        if self.bias:
            self.b = b.param(f"{self.name}.bias", (self.cout,), "zeros")
        return (self.cout, _out(h, self.k, self.s, self.p), _out(w, self.k, self.s, self.p))

    def _pointwise(self) -> bool:
        return self.k == 1 and self.s == 1 and self.p == 0

    def forward(self, x, P, ctx):
        n, h, w, c = x.shape
        k, s, p = self.k, self.s, self.p
        ho, wo = _out(h, k, s, p), _out(w, k, s, p)
        wm = P[self.w].transpose(2, 3, 1, 0).reshape(k * k * c, self.cout)
        cols = x.reshape(n * h * w, c) if self._pointwise() else im2col(_pad(x, p), k, s, ho, wo)
        y = cols @ wm
        if self.bias:
            y += P[self.b]
        return y.reshape(n, ho, wo, self.cout), (cols, wm, x.shape)

    def backward(self, dy, cache, P, G, need_dx=True):
        cols, wm, shape = cache
        n, h, w, c = shape
        k, s, p = self.k, self.s, self.p
        dy2 = dy.reshape(-1, self.cout)
        G[self.w][...] = (cols.T @ dy2).reshape(k, k, c, self.cout).transpose(3, 2, 0, 1)
        if self.bias:
            G[self.b][...] = dy2.sum(axis=0)
        if not need_dx:
            return None
        dcols = dy2 @ wm.T
        if self._pointwise():
            return dcols.reshape(shape)
        ho, wo = dy.shape[1], dy.shape[2]
        dcols = dcols.reshape(n, ho, wo, k, k, c)
        dxp = np.zeros((n, h + 2 * p, w + 2 * p, c), dtype=dy.dtype)
        for i, j, sl in _offsets(k, s, ho, wo):
            dxp[sl] += dcols[:, :, :, i, j, :]
        return dxp[:, p : p + h, p : p + w, :] if p else dxp

    def torch_forward(self, x, P, ctx):
        import torch.nn.functional as F

        return F.conv2d(x, P[self.w], P[self.b] if self.bias else None, self.s, self.p)


class DepthwiseConv2d(Layer):
    """One k x k filter per channel (MobileNet); weight (C, 1, k, k) as in torch groups=C."""

    def __init__(self, k: int, name: str, stride: int = 1, pad: int | None = None) -> None:
        self.k, self.name, self.s = k, name, stride
        self.p = k // 2 if pad is None else pad

    def build(self, in_shape, b):
        c, h, w = in_shape
        self.c = c
        kk = self.k * self.k
        self.w = b.param(f"{self.name}.weight", (c, 1, self.k, self.k), "he", kk, kk, decay=True)
        return (c, _out(h, self.k, self.s, self.p), _out(w, self.k, self.s, self.p))

    def forward(self, x, P, ctx):
        n, h, w, c = x.shape
        k, s, p = self.k, self.s, self.p
        ho, wo = _out(h, k, s, p), _out(w, k, s, p)
        wk = P[self.w][:, 0].transpose(1, 2, 0)  # (k, k, C)
        xp = _pad(x, p)
        y = np.zeros((n, ho, wo, c), dtype=x.dtype)
        tmp = np.empty_like(y)
        for i, j, sl in _offsets(k, s, ho, wo):
            y += np.multiply(xp[sl], wk[i, j], out=tmp)
        return y, (xp, wk, x.shape)

    def backward(self, dy, cache, P, G, need_dx=True):
        xp, wk, shape = cache
        n, h, w, c = shape
        k, s, p = self.k, self.s, self.p
        ho, wo = dy.shape[1], dy.shape[2]
        dw = np.empty((k, k, c), dtype=dy.dtype)
        dxp = np.zeros(xp.shape, dtype=dy.dtype) if need_dx else None
        tmp = np.empty_like(dy)
        for i, j, sl in _offsets(k, s, ho, wo):
            dw[i, j] = np.multiply(dy, xp[sl], out=tmp).sum(axis=(0, 1, 2))
            if need_dx:
                dxp[sl] += np.multiply(dy, wk[i, j], out=tmp)
        G[self.w][...] = dw.transpose(2, 0, 1)[:, None]
        if not need_dx:
            return None
        return dxp[:, p : p + h, p : p + w, :] if p else dxp

    def torch_forward(self, x, P, ctx):
        import torch.nn.functional as F

        return F.conv2d(x, P[self.w], None, self.s, self.p, groups=self.c)
