"""Shared pieces of the engine tests: building one layer alone and finite differences."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from engine.base import Builder, Ctx, Layer


class Bound:
    """One layer built on its own: a float64 parameter vector and named views of it."""

    def __init__(self, layer: Layer, in_shape: tuple[int, ...], seed: int = 0) -> None:
        self.layer, self.builder = layer, Builder()
        self.out_shape = layer.build(in_shape, self.builder)
        rng = np.random.default_rng(seed)
        n = sum(s.size for s in self.builder.params)
        self.params = rng.standard_normal(n) * 0.5
        for s in self.builder.params:
            if s.init == "ones":  # batch-norm scale: keep it near 1 as in a real net
                s.view(self.params)[...] += 1.0
        self.buffers = np.abs(rng.standard_normal(sum(s.size for s in self.builder.buffers)))

    def P(self, flat: np.ndarray) -> dict[str, np.ndarray]:
        return {s.name: s.view(flat) for s in self.builder.params}

    def ctx(self, training: bool = True) -> Ctx:
        return Ctx(training, seed=3, step=5, shard=2,
                   buffers={s.name: s.view(self.buffers) for s in self.builder.buffers})


def numeric_grad(f: Callable[[], float], arr: np.ndarray, idx: np.ndarray,
                 eps: float = 1e-6) -> np.ndarray:
    """Central differences of f with respect to arr.flat[idx] (arr is changed in place)."""
    flat = arr.reshape(-1)
    out = np.empty(len(idx))
    for n, i in enumerate(idx):
        keep = flat[i]
        flat[i] = keep + eps
        up = f()
        flat[i] = keep - eps
        down = f()
        flat[i] = keep
        out[n] = (up - down) / (2 * eps)
    return out


def sample_idx(size: int, k: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.choice(size, size=min(k, size), replace=False)
