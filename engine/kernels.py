"""The two ways a layer multiplies and sums: a job's `exactness`.

* `portable` (engine.portable): products through integer-valued float64 BLAS, sums in a fixed
  pairwise order, exp and log from + - x /: a shard's result is the same bytes on every CPU.
* `class`: numpy's float32 BLAS, its own reductions and its SIMD exp and log: faster, but the
  bits depend on the compute class (CPU architecture, BLAS kernel, numpy's SIMD level), so a
  `class` job keeps its shards on one class (agent: engine.compute_class).

Layers call the kernels of their call's context (`Ctx.kernels`); nothing else differs.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from engine import portable

EXACTNESS = ("portable", "class")
# what a job spec without `exactness` gets: portable costs 1.8-2.8x class per shard (float64 GEMMs
# and the passes that make their operands integers: docs/benchmarks.md), past the 1.5x that
# would make it the default; a class job keeps its shards on one compute class instead
DEFAULT_EXACTNESS = "class"


class Kernels(Protocol):
    name: str

    def matmul(self, a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """a (M, K) @ b (K, N)."""

    def colsum(self, x: np.ndarray) -> np.ndarray:
        """(N, C) -> (C,): the sum of the rows."""

    def sum_axis(self, x: np.ndarray, axis: int) -> np.ndarray:
        """The sum along `axis`, in x's dtype."""

    def total(self, x: np.ndarray) -> float:
        """The sum of a float64 vector, as a Python float."""

    def exp(self, x: np.ndarray) -> np.ndarray:
        """e^x in x's dtype."""

    def log(self, x: np.ndarray) -> np.ndarray:
        """log x in x's dtype."""

    def operand(self, x: np.ndarray, k: int) -> tuple[np.ndarray, Operand]:
        """x made ready to be the left factor of products over at most k terms, whole or by
        rows of its windows (conv's im2col): its values and how to read them."""

    def product(self, a: np.ndarray, how: Operand, b: np.ndarray,
                out: np.ndarray | None = None) -> np.ndarray:
        """a @ b for `a` made by `operand` (or rows of its windows copied as `window_dtype`)."""

    def window_dtype(self, dtype: np.dtype) -> np.dtype:
        """What im2col copies windows of an operand of `dtype` into."""


# how to read an operand's values: (scale, bits); the class kernels' operand is x itself
Operand = tuple[float, int]


class ClassKernels:
    name = "class"

    def matmul(self, a, b, out=None):
        return np.matmul(a, b, out=out)

    def colsum(self, x):
        return np.ones(x.shape[0], dtype=x.dtype) @ x  # a GEMV: one fast pass

    def sum_axis(self, x, axis):
        return x.sum(axis=axis)

    def total(self, x):
        return float(x.sum())

    def exp(self, x):
        return np.exp(x)

    def log(self, x):
        return np.log(x)

    def window_dtype(self, dtype):
        return dtype

    def operand(self, x, k):
        return x, (1.0, 0)

    def product(self, a, how, b, out=None):
        return np.matmul(a, b, out=out)


class PortableKernels:
    name = "portable"

    def matmul(self, a, b, out=None):
        return portable.matmul(a, b, out)

    def colsum(self, x):
        return portable.fold(x, 0)

    def sum_axis(self, x, axis):
        return portable.fold(x, axis)

    def total(self, x):
        return float(portable.fold(np.asarray(x, np.float64).ravel(), 0))

    def exp(self, x):
        return portable.exp(x).astype(x.dtype)

    def log(self, x):
        return portable.log(x).astype(x.dtype)

    def window_dtype(self, dtype):
        return np.dtype(np.float64)  # the GEMM's own: windows are copied once, widened

    def operand(self, x, k):
        ints, scale, bits = portable.whole_integers(x, k)
        return ints, (scale, bits)

    def product(self, a, how, b, out=None):
        return portable.matmul_scaled(a, how[0], how[1], b, out)


CLASS = ClassKernels()
PORTABLE = PortableKernels()


def kernels_for(exactness: str) -> Kernels:
    if exactness == "portable":
        return PORTABLE
    if exactness == "class":
        return CLASS
    raise ValueError(f"unknown exactness {exactness!r}; one of {', '.join(EXACTNESS)}")
