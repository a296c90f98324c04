"""Wire precision of shard gradients: half the bytes, exactly the same math everywhere.

A job may upload each shard's gradient sum in bfloat16 or float16 (`upload_precision`). The
rounding happens in `compute_shard`, so the phone, the simulator and the reference trainer all
sum the very same rounded values (invariant 1 holds bit for bit); the wire then carries them
without further loss. The rule is IEEE round-to-nearest, ties to even: numpy's cast for float16;
for bfloat16 (float32's upper 16 bits) the same rule on the bit pattern. float16 overflows past
65504 (the upload is refused as not finite): bfloat16 keeps float32's range and is the one to use
for gradient sums; float16 keeps 3 more bits of mantissa where values stay small.

Sums of shard results up the reduction tree (engine.tree) are rounded by `node_precision`: to
the upload precision for bfloat16 (so a phone's partial of many shards travels in bfloat16 too),
never to float16 (a sum of gradients leaves its range: inner nodes stay float32, and a float16
job's phones upload each shard's result, not partials).
"""

from __future__ import annotations

import numpy as np

PRECISIONS = ("float32", "bfloat16", "float16")


def to_bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> the uint16 bit patterns of its bfloat16 rounding (nearest, ties to even)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    u = x.view(np.uint32)
    bias = ((u >> 16) & np.uint32(1)) + np.uint32(0x7FFF)
    bits = ((u + bias) >> 16).astype(np.uint16)  # NaN patterns could wrap around to 0 here
    nan = np.isnan(x)
    if nan.any():
        bits[nan] = ((u[nan] >> 16) | np.uint32(0x0040)).astype(np.uint16)  # a quiet NaN
    return bits


def from_bfloat16_bits(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def round_to(x: np.ndarray, precision: str) -> np.ndarray:
    """x (float32) rounded to `precision` and kept as float32: every value is representable in
    the narrow format, so sending it there and back is exact."""
    if precision == "float32":
        return x
    if precision == "bfloat16":
        return from_bfloat16_bits(to_bfloat16_bits(x))
    if precision == "float16":
        with np.errstate(over="ignore"):  # past 65504: inf, refused by the wire as not finite
            return x.astype(np.float16).astype(np.float32)
    raise ValueError(f"unknown precision {precision!r}; one of {', '.join(PRECISIONS)}")


def node_precision(upload_precision: str) -> str:
    """What a sum of two tree nodes is rounded to, for a job uploading in `upload_precision`."""
    return "float32" if upload_precision == "float16" else upload_precision


def can_pre_add(upload_precision: str) -> bool:
    """Whether phones may upload partials (sums of shards) for such a job: only where a partial
    travels in the precision a shard's result does."""
    return node_precision(upload_precision) == upload_precision
