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

from engine.base import Builder, Layer

CHUNK_FLOATS = 1 << 18  # 1 MiB of float32 columns per chunk


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


def _windows(xp: np.ndarray, k: int, s: int, ho: int, wo: int) -> np.ndarray:
    """The (N, Ho, Wo, k, k, C) view of a padded NHWC array's k x k windows (no copy)."""
    n, _, _, c = xp.shape
    sn, sh, sw, sc = xp.strides
    return as_strided(xp, (n, ho, wo, k, k, c), (sn, sh * s, sw * s, sh, sw, sc),
                      writeable=False)


def im2col(xp: np.ndarray, k: int, s: int, ho: int, wo: int) -> np.ndarray:
    """(N*Ho*Wo, k*k*C) windows of a padded NHWC array, column order (ki, kj, c)."""
    n, c = xp.shape[0], xp.shape[3]
    return np.ascontiguousarray(_windows(xp, k, s, ho, wo)).reshape(n * ho * wo, k * k * c)


def _chunks(n: int, rows_per_image: int, k_cols: int) -> list[tuple[int, int]]:
    """Image ranges whose column matrix stays around 1 MiB, i.e. inside the L2 cache."""
    per = max(1, CHUNK_FLOATS // max(rows_per_image * k_cols, 1))
    return [(a, min(a + per, n)) for a in range(0, n, per)]


class Conv2d(Layer):
    """Chunked im2col + GEMM: a few images at a time, the column matrix is built in a buffer
    that stays in cache and fed straight to the GEMM, and rebuilt in backward rather than
    kept (measured: ~40% faster than one big column matrix, and far less memory)."""

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
        kern = ctx.kernels
        # the input as the left factor of the forward's products and the weight gradient's
        src, how = kern.operand(x, max(k * k * c, n * ho * wo))
        if self._pointwise():
            y = kern.product(src.reshape(n * h * w, c), how, wm)
        else:
            src = _pad(src, p)
            y = np.empty((n * ho * wo, self.cout), dtype=x.dtype)
            win = _windows(src, k, s, ho, wo)
            buf = None
            for a, b in _chunks(n, ho * wo, k * k * c):
                buf = _take(win[a:b], buf, kern.window_dtype(src.dtype))
                kern.product(buf.reshape(-1, k * k * c), how, wm,
                             out=y[a * ho * wo : b * ho * wo])
        if self.bias:
            y += P[self.b]
        return y.reshape(n, ho, wo, self.cout), (src, how, wm, x.shape, kern)

    def backward(self, dy, cache, P, G, need_dx=True):
        src, how, wm, shape, kern = cache
        c = shape[3]
        k = self.k
        dy2 = dy.reshape(-1, self.cout)
        if self.bias:
            G[self.b][...] = kern.colsum(dy2)
        if self._pointwise():
            dwm = kern.product(src.reshape(-1, c).T, how, dy2)
            if need_dx:
                dyq, dy_how = kern.operand(dy2, self.cout)
                dx = kern.product(dyq, dy_how, wm.T).reshape(shape)
            else:
                dx = None
        else:
            dwm, dx = self._backward_chunked(dy2, src, how, wm, shape, dy.shape[1], dy.shape[2],
                                             need_dx, kern)
        G[self.w][...] = dwm.reshape(k, k, c, self.cout).transpose(3, 2, 0, 1)
        return dx

    def _backward_chunked(self, dy2, xp, how, wm, shape, ho, wo, need_dx, kern):
        n, h, w, c = shape
        k, s, p = self.k, self.s, self.p
        kc = k * k * c
        win = _windows(xp, k, s, ho, wo)
        dwm = np.zeros((kc, self.cout), dtype=dy2.dtype)
        part = np.empty_like(dwm)
        buf = None
        for a, b in _chunks(n, ho * wo, kc):
            buf = _take(win[a:b], buf, kern.window_dtype(xp.dtype))
            # chunks in a fixed order (their size depends on the shapes alone)
            dwm += kern.product(buf.reshape(-1, kc).T, how, dy2[a * ho * wo : b * ho * wo],
                                out=part)
        if not need_dx:
            return dwm, None
        dy = dy2.reshape(n, ho, wo, self.cout)
        if s == 1 and p <= k - 1:
            return dwm, self._dx_as_conv(dy, wm, shape, kern)
        return dwm, self._dx_col2im(dy, wm, shape, xp.shape, kern)

    def _dx_as_conv(self, dy, wm, shape, kern):
        """Stride 1: dx is dy, padded by k-1-p, convolved with the flipped kernel (channels
        swapped): the same chunked im2col + GEMM as forward, written straight into dx."""
        n, h, w, c = shape
        k, q = self.k, self.k - 1 - self.p
        # wm rows are (i, j, c); the flipped kernel wants rows (k-1-i, k-1-j, cout)
        wf = wm.reshape(k, k, c, self.cout)[::-1, ::-1].transpose(0, 1, 3, 2)
        wfm = np.ascontiguousarray(wf).reshape(k * k * self.cout, c)
        dyq, how = kern.operand(dy, k * k * self.cout)
        win = _windows(_pad(dyq, q), k, 1, h, w)
        dx = np.empty((n * h * w, c), dtype=dy.dtype)
        buf = None
        for a, b in _chunks(n, h * w, k * k * self.cout):
            buf = _take(win[a:b], buf, kern.window_dtype(dyq.dtype))
            kern.product(buf.reshape(-1, k * k * self.cout), how, wfm,
                         out=dx[a * h * w : b * h * w])
        return dx.reshape(shape)

    def _dx_col2im(self, dy, wm, shape, padded_shape, kern):
        """Strided convs: scatter each kernel offset's columns back with one strided add."""
        n, h, w, c = shape
        k, s, p = self.k, self.s, self.p
        ho, wo = dy.shape[1], dy.shape[2]
        dy2, how = kern.operand(dy.reshape(-1, self.cout), self.cout)
        if dy2.dtype != kern.window_dtype(dy2.dtype):  # widened once, not per offset
            dy2 = dy2.astype(kern.window_dtype(dy2.dtype))
        w_off = wm.reshape(k, k, c, self.cout)
        dxp = np.zeros(padded_shape, dtype=dy.dtype)
        part = np.empty((n * ho * wo, c), dtype=dy.dtype)
        for i, j, sl in _offsets(k, s, ho, wo):
            # contiguous, so the add walks long runs
            kern.product(dy2, how, w_off[i, j].T, out=part)
            dxp[sl] += part.reshape(n, ho, wo, c)
        return dxp[:, p : p + h, p : p + w, :] if p else dxp

    def torch_forward(self, x, P, ctx):
        import torch.nn.functional as F

        return F.conv2d(x, P[self.w], P[self.b] if self.bias else None, self.s, self.p)


def _take(win: np.ndarray, buf: np.ndarray | None, dtype: np.dtype) -> np.ndarray:
    """Copy a window view into a reused buffer of `dtype` (a fresh one when the chunk size
    changes)."""
    if buf is None or buf.shape != win.shape:
        buf = np.empty(win.shape, dtype=dtype)
    np.copyto(buf, win)
    return buf


class DepthwiseConv2d(Layer):
    """One k x k filter per channel (MobileNet); weight (C, 1, k, k) as in torch groups=C.

    Each kernel offset is one multiply-add over a strided slice; a few images at a time, so
    the k*k passes over a chunk run in cache rather than in memory."""

    def __init__(self, k: int, name: str, stride: int = 1, pad: int | None = None) -> None:
        self.k, self.name, self.s = k, name, stride
        self.p = k // 2 if pad is None else pad

    def build(self, in_shape, b):
        c, h, w = in_shape
        self.c = c
        kk = self.k * self.k
        self.w = b.param(f"{self.name}.weight", (c, 1, self.k, self.k), "he", kk, kk, decay=True)
        return (c, _out(h, self.k, self.s, self.p), _out(w, self.k, self.s, self.p))

    def _chunks(self, xp: np.ndarray, ho: int, wo: int) -> list[tuple[int, int]]:
        per_image = xp.shape[1] * xp.shape[2] * xp.shape[3] + 2 * ho * wo * xp.shape[3]
        return _chunks(xp.shape[0], 1, per_image)

    def forward(self, x, P, ctx):
        n, h, w, c = x.shape
        k, s, p = self.k, self.s, self.p
        ho, wo = _out(h, k, s, p), _out(w, k, s, p)
        wk = np.ascontiguousarray(P[self.w][:, 0].transpose(1, 2, 0))  # (k, k, C)
        xp = _pad(x, p)
        y = np.empty((n, ho, wo, c), dtype=x.dtype)
        tmp = None
        for a, b in self._chunks(xp, ho, wo):
            xc, yc = xp[a:b], y[a:b]
            if tmp is None or tmp.shape != yc.shape:
                tmp = np.empty_like(yc)
            for i, j, sl in _offsets(k, s, ho, wo):
                if i == 0 and j == 0:
                    np.multiply(xc[sl], wk[0, 0], out=yc)
                else:
                    yc += np.multiply(xc[sl], wk[i, j], out=tmp)
        return y, (xp, wk, x.shape, ctx.kernels)

    def backward(self, dy, cache, P, G, need_dx=True):
        xp, wk, shape, kern = cache
        n, h, w, c = shape
        k, s, p = self.k, self.s, self.p
        ho, wo = dy.shape[1], dy.shape[2]
        dw = np.zeros((k, k, c), dtype=dy.dtype)
        dxp = np.zeros(xp.shape, dtype=dy.dtype) if need_dx else None
        tmp = None
        for a, b in self._chunks(xp, ho, wo):
            xc, dyc = xp[a:b], dy[a:b]
            if tmp is None or tmp.shape != dyc.shape:
                tmp = np.empty_like(dyc)
            for i, j, sl in _offsets(k, s, ho, wo):
                dw[i, j] += kern.colsum(np.multiply(dyc, xc[sl], out=tmp).reshape(-1, c))
                if need_dx:
                    dxp[a:b][sl] += np.multiply(dyc, wk[i, j], out=tmp)
        G[self.w][...] = dw.transpose(2, 0, 1)[:, None]
        if not need_dx:
            return None
        return dxp[:, p : p + h, p : p + w, :] if p else dxp

    def torch_forward(self, x, P, ctx):
        import torch.nn.functional as F

        return F.conv2d(x, P[self.w], None, self.s, self.p, groups=self.c)
