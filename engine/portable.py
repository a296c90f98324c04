"""Arithmetic whose bits are a function of its inputs alone, on any IEEE-754 CPU.

What changes a float32 result from one CPU to the next is never + - x / sqrt themselves (IEEE
rounds each correctly, and numpy never fuses two ufunc calls into one FMA) but the *order* of
a sum (BLAS kernels block and vectorise differently on every CPU, numpy's SIMD loops too) and
the transcendental functions (each libm and each SIMD loop has its own last bit). So here:

* products (`matmul`) go through float64 BLAS on *integer-valued* operands: each row of `a`
  and each column of `b` is scaled by a power of two and rounded to an integer of at most
  p and q bits, with p + q + ceil(log2 K) <= 53. Every partial sum any kernel can form, in any
  order, FMA or not, is then an integer below 2^53: exact. The integer product scaled back is
  rounded to float32 once. The rounding to p and q bits (about 19-26 bits for the sizes our
  models have) is the only loss, and it is itself a function of the inputs (the Ozaki
  scheme's first slice, docs/engine.md);
* sums over an axis (`fold`) add rows pairwise in an order fixed by the length alone,
  element-wise: no BLAS, no `einsum`, no reduction loop of numpy's;
* `exp`, `log`, `cos` and integer powers are polynomials and range reductions written with
  + - x / on float64 arrays (or Python floats), so every machine runs the same operations;
* normal draws (`normal`) use the polar method on the generator's portable uniform doubles
  and `log` above (numpy's ziggurat calls the platform's libm in its tails).

None of it depends on numpy's version, build, SIMD dispatch, BLAS library, kernel or thread
count. tests/engine/test_portable.py proves it under other OpenBLAS kernels and SIMD levels;
tests/arm64/ under ARM64 CPUs (qemu).
"""

from __future__ import annotations

import math

import numpy as np

MANTISSA_BITS = 53  # float64: every integer up to 2^53 is exact
# p and q above are at most this: float32 holds 24 significant bits, and a few more keep
# elements well below their row's largest one
MAX_OPERAND_BITS = 26


def _budget(k: int) -> int:
    """p + q for a product over k terms: every partial sum below 2^53."""
    return MANTISSA_BITS - max(k - 1, 0).bit_length()


def operand_bits(k: int) -> tuple[int, int]:
    """(p, q): the bits each operand of a product over K terms is rounded to."""
    budget = _budget(k)
    if budget < 8:
        raise ValueError(f"a product over {k:,} terms is too long for exact float64 sums")
    p = min(budget // 2, MAX_OPERAND_BITS)
    return p, min(budget - p, MAX_OPERAND_BITS)


def _scaled_integers(m: np.ndarray, axis: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """m as float64 integers of at most `bits` bits, each line along `axis` (the product's K)
    scaled by its own power of two; and the powers of two that scale them back."""
    if m.size:  # the largest magnitude per line, without a temporary |m|
        amax = np.maximum(m.max(axis=axis, keepdims=True), -m.min(axis=axis, keepdims=True))
    else:
        amax = np.zeros((1, 1), m.dtype)
    _, e = np.frexp(amax)  # |line| < 2^e (e = 0 for a line of zeros)
    up = bits - e.astype(np.int64)
    if m.dtype == np.float32 and up.min(initial=0) >= -126 and up.max(initial=0) <= 127:
        # in float32, then widened (half the bytes to pass over): a power-of-two scaling is
        # exact, except that an element below 2^-126 after it loses bits, and such an
        # element rounds to the integer 0 in any case; above 2^24 every float32 is an integer
        scaled = m * _pow2(up).astype(np.float32)
        np.rint(scaled, out=scaled)
        out = scaled.astype(np.float64)
    else:
        out = np.multiply(m, _pow2(up), dtype=np.float64)  # a power of two: exact
        np.rint(out, out=out)  # to the nearest integer, ties to even
    return out, _pow2(-up)


def _pow2(e: np.ndarray) -> np.ndarray:
    """2.0 ** e for integer arrays e in float64's normal range, built from its bits."""
    return ((np.asarray(e, np.int64) + 1023) << 52).view(np.float64)


def matmul(a: np.ndarray, b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """a (M, K) @ b (K, N) in their dtype, the same bits on every CPU (see the module doc)."""
    k = a.shape[1]
    if b.shape[0] != k:
        raise ValueError(f"matmul: {a.shape} @ {b.shape}")
    p, q = operand_bits(k)
    ai, a_scale = _scaled_integers(a, 1, p)  # a_scale (M, 1)
    return _integer_product(ai, a_scale, b, q, out, np.result_type(a.dtype, b.dtype))


def _integer_product(ai: np.ndarray, a_scale: np.ndarray | float, b: np.ndarray, q: int,
                     out: np.ndarray | None, dtype: np.dtype) -> np.ndarray:
    """(ai x a_scale) @ b, ai integers: b's columns rounded to q bits, the float64 product of
    integers (exact, whatever the kernel), scaled back and rounded once into `out`."""
    bi, b_scale = _scaled_integers(b, 0, q)  # b_scale (1, N)
    c = (ai if ai.dtype == np.float64 else ai.astype(np.float64)) @ bi
    c *= a_scale
    if out is None:
        out = np.empty(c.shape, dtype)
    np.multiply(c, b_scale, out=out, casting="unsafe")  # exact, then rounded once to out's type
    return out


# Integers held in float32 are exact up to 2^24: a whole-tensor operand (below) keeps at most
# this many bits, so a conv's input can stay float32 in its cache and in im2col's windows
FLOAT32_INT_BITS = 24


def whole_integers(x: np.ndarray, k: int) -> tuple[np.ndarray, float, int]:
    """x (float32) as integers of at most p bits kept in float32, one power-of-two scale for
    the whole tensor, for products over at most `k` terms: (integers, scale, p). A conv's
    input made so once serves every window of im2col (each window a row of integers sharing
    the scale), so the big column matrix is copied, never scanned and rounded."""
    p = min(FLOAT32_INT_BITS, operand_bits(k)[0])
    amax = max(float(x.max()), -float(x.min())) if x.size else 0.0
    _, e = math.frexp(amax)  # |x| < 2^e
    if -126 <= p - e <= 127:  # the power of two is a float32: scale in float32 (exact)
        ints = x * np.float32(2.0 ** (p - e))
        np.rint(ints, out=ints)
    else:
        ints = np.rint(x.astype(np.float64) * 2.0 ** (p - e)).astype(np.float32)
    return ints, 2.0 ** (e - p), p


def matmul_scaled(a: np.ndarray, a_scale: float, a_bits: int, b: np.ndarray,
                  out: np.ndarray | None = None) -> np.ndarray:
    """(a x a_scale) @ b as float32, a made by `whole_integers` (or a copy of its windows, in
    any float dtype); b's columns scaled and rounded here to what the bits leave."""
    k = a.shape[1]
    q = min(MAX_OPERAND_BITS, _budget(k) - a_bits)
    if q < 8:
        raise ValueError(f"a product over {k:,} terms leaves too few bits for exact sums")
    return _integer_product(a, a_scale, b, q, out, np.dtype(np.float32))


def fold(x: np.ndarray, axis: int = 0) -> np.ndarray:
    """The sum along `axis` of x, in x's dtype: rows [0, h) and [h, n) added element-wise,
    h = ceil(n / 2), until one is left (an odd count's middle row goes up as it is). The pairs
    depend on the length only. One scratch array: each level adds into its own first rows."""
    x = np.moveaxis(np.asarray(x), axis, 0)
    n = x.shape[0]
    if n <= 1:
        return x[0].copy() if n else np.zeros(x.shape[1:], x.dtype)
    h = (n + 1) // 2
    acc = np.empty((h, *x.shape[1:]), x.dtype)
    np.add(x[: n - h], x[h:n], out=acc[: n - h])
    if h > n - h:
        acc[n - h] = x[n - h]
    n = h
    while n > 1:
        h = (n + 1) // 2
        # writes rows [0, n - h), reads rows [h, n): apart, since n - h <= h
        np.add(acc[: n - h], acc[h:n], out=acc[: n - h])
        n = h
    return acc[0].copy()


# exp: x = k ln2 + r, |r| <= ln2 / 2, ln2 in two parts (fdlibm's) so k x LN2_HI is exact
LN2_HI = 6.93147180369123816490e-01
LN2_LO = 1.90821492927058770002e-10
INV_LN2 = 1.44269504088896338700e00
_EXP_TERMS = 14  # r^14 / 14! < 2^-60 for |r| <= 0.35


def exp(x: np.ndarray) -> np.ndarray:
    """e^x in float64 for float32 or float64 x, within about 2 ulp of float64; inputs below
    -746 give 0 and above 709 give inf, as float64 would. Round to float32 at the caller."""
    x = np.asarray(x, dtype=np.float64)
    big = x > 709.0
    xc = np.clip(np.nan_to_num(x, nan=0.0), -746.0, 709.0)  # NaN set back below
    k = np.rint(xc * INV_LN2)
    r = xc - k * LN2_HI
    r -= k * LN2_LO
    poly = np.full_like(r, 1.0 / math.factorial(_EXP_TERMS))
    for i in range(_EXP_TERMS - 1, -1, -1):
        poly *= r
        poly += 1.0 / math.factorial(i)
    # 2^k in two halves so that k down to -1077 never leaves float64's normal range early
    half = np.floor(k * 0.5)
    out = poly * _pow2(half)
    out *= _pow2(k - half)
    out[big] = np.inf
    out[np.isnan(x)] = np.nan
    return out


SQRT_HALF = 0.70710678118654757
_LOG_TERMS = 12  # s^(2*12+1) / 25 < 2^-60 for |s| <= 0.1716


def log(x: np.ndarray) -> np.ndarray:
    """Natural log in float64 of positive, finite float32 or float64 x (0 gives -inf)."""
    x = np.asarray(x, dtype=np.float64)
    m, e = np.frexp(x)  # x = m 2^e, m in [0.5, 1): exact
    low = m < SQRT_HALF
    m[low] *= 2.0
    e = e - low  # m in [sqrt(1/2), sqrt(2))
    s = (m - 1.0) / (m + 1.0)
    s2 = s * s
    poly = np.full_like(s, 1.0 / (2 * _LOG_TERMS + 1))
    for i in range(_LOG_TERMS - 1, -1, -1):
        poly *= s2
        poly += 1.0 / (2 * i + 1)
    ef = e.astype(np.float64)
    out = 2.0 * s * poly
    out += ef * LN2_LO
    out += ef * LN2_HI
    out[x == 0] = -np.inf
    out[(x < 0) | np.isnan(x)] = np.nan
    return out


def _cos_poly(t: float) -> float:
    t2, term, total = t * t, 1.0, 1.0
    for i in range(1, 10):  # t^18 / 18! < 2^-58 for |t| <= pi / 4
        term = -term * t2 / ((2 * i - 1) * (2 * i))
        total += term
    return total


def _sin_poly(t: float) -> float:
    t2, term, total = t * t, t, t
    for i in range(1, 10):
        term = -term * t2 / ((2 * i) * (2 * i + 1))
        total += term
    return total


def cos(x: float) -> float:
    """cos(x) for x in [0, pi] (the cosine schedule's range) from + - x / alone."""
    if not 0.0 <= x <= math.pi:
        raise ValueError(f"cos: {x} is outside [0, pi]")
    if x <= math.pi / 4:
        return _cos_poly(x)
    if x <= 3 * math.pi / 4:
        return _sin_poly(math.pi / 2 - x)
    return -_cos_poly(math.pi - x)


def powi(base: float, n: int) -> float:
    """base ** n for an integer n >= 0 by repeated squaring (Python's float ** calls libm)."""
    if n < 0:
        raise ValueError("powi: negative exponent")
    out, square = 1.0, float(base)
    while n:
        if n & 1:
            out *= square
        square *= square
        n >>= 1
    return out


def normal(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Standard normal float64 draws by Marsaglia's polar method: pairs (u, v) uniform in the
    square, kept inside the unit circle, scaled by sqrt(-2 log(s) / s). The uniforms are
    numpy's portable doubles (53 bits of the generator's integers) and the log is ours, so
    the draws are the same on every machine."""
    size = math.prod(shape)
    out = np.empty(size, np.float64)
    filled = 0
    while filled < size:
        pairs = (size - filled) * 2 // 3 + 8  # pi / 4 of the pairs are kept
        uv = rng.random(2 * pairs) * 2.0 - 1.0
        u, v = uv[0::2], uv[1::2]
        s = u * u + v * v
        keep = (s > 0.0) & (s < 1.0)
        u, v, s = u[keep], v[keep], s[keep]
        f = np.sqrt(-2.0 * log(s) / s)
        z = np.empty(2 * u.size, np.float64)
        z[0::2], z[1::2] = u * f, v * f
        take = min(size - filled, z.size)
        out[filled : filled + take] = z[:take]
        filled += take
    return out.reshape(shape)
