"""Batch normalisation with statistics of the shard's own micro-batch.

Training normalises with the micro-batch mean and biased variance (as torch does) and reports
the mean and the unbiased variance as the shard's `stats`; `apply_step` averages the shards'
stats in shard order and moves the running buffers, which evaluation uses. So the buffers after
step t are the same whichever devices computed which shards.
"""

from __future__ import annotations

import numpy as np

from engine.base import Builder, Layer

EPS = 1e-5


class BatchNorm(Layer):
    def __init__(self, name: str) -> None:
        self.name = name

    def build(self, in_shape: tuple[int, ...], b: Builder) -> tuple[int, ...]:
        c = in_shape[0]
        self.g = b.param(f"{self.name}.weight", (c,), "ones")
        self.b = b.param(f"{self.name}.bias", (c,), "zeros")
        # buffers and stats are declared in the same order: stat i feeds buffer i
        self.rm = b.buffer(f"{self.name}.running_mean", (c,), "zeros")
        self.rv = b.buffer(f"{self.name}.running_var", (c,), "ones")
        self.sm = b.stat(f"{self.name}.running_mean", (c,))
        self.sv = b.stat(f"{self.name}.running_var", (c,))
        return in_shape

    def forward(self, x, P, ctx):
        c = x.shape[-1]
        x2 = x.reshape(-1, c)
        if not ctx.training:
            inv = 1.0 / np.sqrt(ctx.buffers[self.rv] + EPS)
            scale = (P[self.g] * inv).astype(x.dtype)
            y = x2 * scale + (P[self.b] - ctx.buffers[self.rm] * scale).astype(x.dtype)
            return y.reshape(x.shape), ("eval", scale)
        n = x2.shape[0]
        kern = ctx.kernels
        mean = kern.colsum(x2) / np.asarray(n, x.dtype)
        xhat = x2 - mean
        var = kern.colsum(xhat * xhat) / np.asarray(n, x.dtype)
        inv = 1.0 / np.sqrt(var + EPS)
        xhat *= inv
        ctx.stats[self.sm] = mean
        ctx.stats[self.sv] = var * (n / (n - 1)) if n > 1 else var
        y = xhat * P[self.g]
        y += P[self.b]
        return y.reshape(x.shape), ("train", xhat, inv, kern)

    def backward(self, dy, cache, P, G, need_dx=True):
        c = dy.shape[-1]
        dy2 = dy.reshape(-1, c)
        if cache[0] == "eval":
            raise RuntimeError("batch norm backward needs a training-mode forward")
        _, xhat, inv, kern = cache
        dbeta = kern.colsum(dy2)
        dgamma = kern.colsum(dy2 * xhat)
        G[self.g][...] = dgamma
        G[self.b][...] = dbeta
        if not need_dx:
            return None
        n = dy2.shape[0]
        dx = xhat * (-dgamma / n)  # (dy - mean(dy) - xhat * mean(dy * xhat)) * gamma / std
        dx += dy2
        dx -= dbeta / n
        dx *= P[self.g] * inv
        return dx.reshape(dy.shape)

    def torch_forward(self, x, P, ctx):
        import torch
        import torch.nn.functional as F

        if not ctx.training:
            return F.batch_norm(x, ctx.buffers[self.rm], ctx.buffers[self.rv], P[self.g],
                                P[self.b], False, 0.0, EPS)
        dims = [0, 2, 3] if x.dim() == 4 else [0]
        with torch.no_grad():
            ctx.stats[self.sm] = x.mean(dim=dims)
            ctx.stats[self.sv] = x.var(dim=dims, unbiased=x.numel() // x.shape[1] > 1)
        return F.batch_norm(x, None, None, P[self.g], P[self.b], True, 0.0, EPS)
