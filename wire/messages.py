"""Wire format for weights and shard results: a small versioned header, then raw arrays.

Layout (all integers little-endian):

    magic  b"PHLXW"  (5 bytes)
    version          u16   (1)
    header length    u32
    crc32            u32   CRC-32 (zlib's) of header + payload
    header           UTF-8 JSON: kind, job, step, dtype, n_params, and per kind
                     weights: n_buffers; results: n_stats and
                     "shards": [{"shard", "loss_sum", "correct", "count"}, ...];
                     padded with spaces so the payload starts at a multiple of 64 bytes
    payload          weights: params f32[n_params] then buffers f32[n_buffers]
                     results: per shard, in header order, grad[n_params] (dtype) then
                     stats f32[n_stats]

Decoding refuses, with a WireError saying why: truncation, a bad magic or version, a checksum
mismatch, a payload of the wrong length, an unexpected kind, job or step, a parameter count that
differs from the caller's model, and NaN or infinity anywhere. No pickle: JSON and raw floats.
"""

from __future__ import annotations

import json
import math
import struct
from typing import Any

import numpy as np

from engine.precision import from_bfloat16_bits, to_bfloat16_bits
from engine.step import ShardResult
from wire.buffers import new_buffer

try:  # the same CRC-32 as zlib's, ~10x faster (zlib-ng's folding kernel); the control plane
    # installs it, a phone without it uses the standard library (1.9 vs 0.19 ms per 12.9 MB)
    from zlib_ng.zlib_ng import crc32, crc32_combine
except ImportError:  # pragma: no cover - depends on what is installed
    from zlib import crc32

    crc32_combine = None

MAGIC = b"PHLXW"
VERSION = 1
_PREFIX = struct.Struct("<5sHII")
# the header is padded with spaces (JSON's whitespace) so the payload starts at a multiple of
# this from the message's start: numpy reads and writes an unaligned float32 view through a
# buffered copy (the server paid ~10% of its CPU for it). A receive buffer is 16-aligned, so
# the arrays are: every float32 one after, a float16 or bfloat16 message's stats only when
# its n_params is even (they are small)
PAYLOAD_ALIGN = 64
# how a results message carries gradients; bfloat16 travels as its uint16 bit patterns
_DTYPES = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2"), "bfloat16": np.dtype("<u2")}
MAX_HEADER = 1 << 22


class WireError(ValueError):
    """A malformed or mismatched message; the text says what is wrong."""


class NotFinite(WireError):
    """A result to encode holds NaN or infinity: the training diverged (or a float16 gradient
    overflowed). Every device computes the same bits, so computing it again will not help."""


def encode_weights(job_id: str, step: int, params: np.ndarray, buffers: np.ndarray,
                   part: tuple[int, int] | None = None) -> bytes:
    """`part`: these are the params [lo, hi) of a sliced job's vector (engine.slices); the
    header says so, and the buffers travel with the slice starting at 0."""
    header = _weights_header(job_id, step, params.size, buffers.size)
    if part is not None:
        header["slice"] = [int(part[0]), int(part[1])]
    return _pack(header, [_f32(params), _f32(buffers)])


def join_weights(job_id: str, step: int, parts: list[bytes | memoryview]) -> list[memoryview]:
    """The whole weights message of a sliced job from its slices' messages, in order, as
    consecutive byte views (for a writer: `b"".join` of them is the message `encode_weights`
    makes of the joined arrays). Each slice's checksum, job, step and sizes are checked, and
    together they must cover the vector once from 0; the values are not decoded here (whoever
    reads the whole message checks them), so joining costs a checksum pass, not a copy."""
    views, buffers, expect = [], None, 0
    for data in parts:
        header, payload = _unpack(data, "weights", job_id, step)
        span = header.get("slice")
        if not (isinstance(span, list) and len(span) == 2 and all(_is_int(v) for v in span)):
            raise WireError("a slice's weights message must say which slice it is")
        if span[0] != expect or span[1] <= span[0]:
            raise WireError(f"slice [{span[0]}, {span[1]}) does not follow [.., {expect})")
        n, b = span[1] - span[0], _count(header, "n_buffers", None)
        if _count(header, "n_params", n) != n or len(payload) != 4 * (n + b):
            raise WireError(f"slice [{span[0]}, {span[1]}): payload of the wrong size")
        if header.get("dtype") != "float32":
            raise WireError(f"weights dtype must be float32, got {header.get('dtype')!r}")
        views.append(payload[: 4 * n])
        buffers = payload[4 * n :] if buffers is None else buffers
        expect = span[1]
    if buffers is None:
        raise WireError("no slices")
    header = _weights_header(job_id, step, expect, len(buffers) // 4)
    return _pack_parts(header, [*views, buffers])


def _weights_header(job_id: str, step: int, n_params: int, n_buffers: int) -> dict[str, Any]:
    return {"kind": "weights", "job": job_id, "step": int(step), "dtype": "float32",
            "n_params": int(n_params), "n_buffers": int(n_buffers)}


class WeightsMessage:
    """A weights message whose arrays are filled in place; `seal()` writes the checksum. Byte
    for byte what `encode_weights` makes of the same arrays.

    The params can be filled a block at a time from any thread (`take_params`, as the update
    finishes each block: the control plane's apply_step), each block checksummed while in the
    cache; `seal()` then combines the blocks' CRCs (zlib-ng's crc32_combine) instead of reading
    the whole message again on the step's critical path."""

    def __init__(self, job_id: str, step: int, n_params: int, n_buffers: int) -> None:
        raw = _header_bytes(_weights_header(job_id, step, n_params, n_buffers))
        self._start = _PREFIX.size + len(raw)
        self.data = new_buffer(self._start + 4 * (n_params + n_buffers))
        _PREFIX.pack_into(self.data, 0, MAGIC, VERSION, len(raw), 0)
        self.data[_PREFIX.size:self._start] = raw
        flat = np.frombuffer(self.data, dtype="<f4", offset=self._start)
        self.params, self.buffers = flat[:n_params], flat[n_params:]
        self._blocks: dict[int, tuple[int, int | None]] = {}  # start -> (stop, its CRC)

    def take_params(self, source: np.ndarray, block: slice) -> None:
        """params[block] = source[block], and that block's CRC kept for `seal()`; from any
        thread, blocks in any order (a dict's item set is atomic under the GIL, and threads
        write disjoint blocks)."""
        self.params[block] = source[block]
        start, stop, _ = block.indices(self.params.size)
        self._blocks[start] = (stop, crc32(self.params[start:stop]) if crc32_combine else None)

    def seal(self) -> memoryview:
        _PREFIX.pack_into(self.data, 0, MAGIC, VERSION, self._start - _PREFIX.size,
                          self._checksum())
        return self.data

    def _checksum(self) -> int:
        if not self._blocks:  # params filled otherwise (whole): read it all
            return crc32(self.data[_PREFIX.size:])
        # taken by blocks: all of them must be there, with or without zlib-ng (a pooled buffer
        # is not zeroed: a block never taken would ship an old message's bytes, CRC and all)
        crc, at = crc32(self.data[_PREFIX.size:self._start]), 0
        for start in sorted(self._blocks):
            stop, piece = self._blocks[start]
            if start != at:
                break
            if piece is not None:
                crc = crc32_combine(crc, piece, 4 * (stop - start))
            at = stop
        if at != self.params.size:
            raise RuntimeError(f"weights message: params taken up to {at} of "
                               f"{self.params.size} (blocks {sorted(self._blocks)[:4]}...)")
        if crc32_combine is None:  # no combining without zlib-ng: read it all
            return crc32(self.data[_PREFIX.size:])
        return crc32(self.buffers, crc)


def decode_weights(data: bytes, expect_job: str | None = None, expect_step: int | None = None,
                   n_params: int | None = None, n_buffers: int | None = None,
                   ) -> tuple[int, np.ndarray, np.ndarray]:
    header, payload = _unpack(data, "weights", expect_job, expect_step)
    p = _count(header, "n_params", n_params)
    b = _count(header, "n_buffers", n_buffers)
    if header.get("dtype") != "float32":
        raise WireError(f"weights dtype must be float32, got {header.get('dtype')!r}")
    if len(payload) != 4 * (p + b):
        raise WireError(f"payload is {len(payload)} bytes, header says {4 * (p + b)}")
    flat = _finite(np.frombuffer(payload, dtype="<f4"), "weights")
    # copies: the caller owns writable arrays, not views that keep the message alive
    return header["step"], flat[:p].astype(np.float32), flat[p:].astype(np.float32)


def encode_results(job_id: str, step: int, results: list[ShardResult],
                   dtype: str = "float32") -> bytes:
    return b"".join(encode_results_parts(job_id, step, results, dtype))


def encode_results_parts(job_id: str, step: int, results: list[ShardResult],
                         dtype: str = "float32") -> list[memoryview]:
    """The results message as consecutive byte views (prefix and header, then each array as
    it is in memory), for a writer or a socket that takes them in order: a model-sized
    message is never copied into one buffer first. `b"".join` of them is `encode_results`."""
    entries, chunks = results_payload(results, dtype)
    return join_results_parts(job_id, step, dtype, int(results[0].grad_sum.size),
                              int(results[0].stats.size), entries, chunks)


def results_payload(results: list[ShardResult], dtype: str = "float32"
                    ) -> tuple[list[dict[str, Any]], list[np.ndarray]]:
    """Each shard's header entry, and its arrays as the message carries them (gradient in
    `dtype`, then stats), in the order given: a shard's arrays are one contiguous segment."""
    if dtype not in _DTYPES:
        raise WireError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    if not results:
        raise WireError("no results to encode")
    n_params, n_stats = int(results[0].grad_sum.size), int(results[0].stats.size)
    chunks: list[np.ndarray] = []
    shards = []
    for r in results:
        if r.grad_sum.size != n_params or r.stats.size != n_stats:
            raise WireError(f"shard {r.shard}: arrays differ in size from shard "
                            f"{results[0].shard}'s")
        if dtype == "bfloat16":
            grad = to_bfloat16_bits(r.grad_sum)
            finite = all_finite(from_bfloat16_bits(grad))
        else:
            with np.errstate(over="ignore"):  # overflow shows up as inf, refused just below
                grad = np.ascontiguousarray(r.grad_sum, dtype=_DTYPES[dtype])  # no copy if f32
            finite = all_finite(grad)
        if not finite:
            raise NotFinite(f"shard {r.shard}: gradient is not finite in {dtype} "
                            "(diverged, or too large for float16)")
        chunks += [grad, _f32(r.stats)]
        entry = {"shard": int(r.shard), "loss_sum": float(r.loss_sum),
                 "correct": int(r.correct), "count": int(r.count)}
        if r.span != 1:  # a partial of shards shard..shard+span-1 (engine.tree); absent: 1
            entry["span"] = int(r.span)
        shards.append(entry)
    return shards, chunks


def segment_bytes(dtype: str, n_params: int, n_stats: int) -> int:
    """The bytes of one shard's arrays in a results message."""
    return _DTYPES[dtype].itemsize * n_params + 4 * n_stats


def join_results_parts(job_id: str, step: int, dtype: str, n_params: int, n_stats: int,
                       entries: list[dict[str, Any]], chunks: list[Any]) -> list[memoryview]:
    """A results message from shards' entries and their arrays' bytes in the same order (as
    `results_payload` gives them, or byte segments another process wrote): no array is
    decoded or copied."""
    if dtype not in _DTYPES:
        raise WireError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    header = {"kind": "results", "job": job_id, "step": int(step), "dtype": dtype,
              "n_params": int(n_params), "n_stats": int(n_stats), "shards": entries}
    return _pack_parts(header, chunks)


def decode_results(data: bytes, expect_job: str | None = None, expect_step: int | None = None,
                   n_params: int | None = None, n_stats: int | None = None,
                   expect_dtype: str | None = None) -> list[ShardResult]:
    header, payload = _unpack(data, "results", expect_job, expect_step)
    p, s = _count(header, "n_params", n_params), _count(header, "n_stats", n_stats)
    dtype = header.get("dtype")
    if dtype not in _DTYPES:
        raise WireError(f"results dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    if expect_dtype is not None and dtype != expect_dtype:
        raise WireError(f"results in {dtype}, but the job uploads in {expect_dtype} "
                        f"(upload_precision): an agent too old for this job?")
    shards = _shard_entries(header)
    gsize = _DTYPES[dtype].itemsize * p
    per = segment_bytes(dtype, p, s)
    if len(payload) != per * len(shards):
        raise WireError(f"payload is {len(payload)} bytes, header says {per * len(shards)}")
    out = []
    for i, meta in enumerate(shards):
        chunk = payload[i * per : (i + 1) * per]
        raw = np.frombuffer(chunk[:gsize], dtype=_DTYPES[dtype])
        grad = _finite(from_bfloat16_bits(raw) if dtype == "bfloat16" else raw, "gradient")
        stats = _finite(np.frombuffer(chunk[gsize:], dtype="<f4"), "stats")
        # float32 arrives as read-only views of the message (no copy of a model-sized vector);
        # float16 is widened into a new array
        out.append(ShardResult(meta["shard"], grad.astype(np.float32, copy=False),
                               meta["loss_sum"], meta["correct"], meta["count"],
                               stats.astype(np.float32, copy=False), meta.get("span", 1)))
    return out


def _pack(header: dict[str, Any], arrays: list[np.ndarray]) -> bytes:
    """One copy of the arrays, into the message itself (a phone has little memory to spare)."""
    return b"".join(_pack_parts(header, arrays))


def _pack_parts(header: dict[str, Any], arrays: list[np.ndarray]) -> list[memoryview]:
    """The message's bytes in order, the arrays not copied (views of them)."""
    raw = _header_bytes(header)
    parts = [memoryview(a).cast("B") for a in arrays]
    crc = crc32(raw)
    for part in parts:
        crc = crc32(part, crc)
    return [memoryview(_PREFIX.pack(MAGIC, VERSION, len(raw), crc) + raw), *parts]


def _header_bytes(header: dict[str, Any]) -> bytes:
    """The header's JSON, padded with spaces to put the payload at a multiple of PAYLOAD_ALIGN
    (a decoder of any version reads the padding as whitespace)."""
    try:
        raw = json.dumps(header, allow_nan=False, separators=(",", ":")).encode()
    except ValueError:
        raise NotFinite("header holds NaN or infinity (a shard's loss is not finite)") from None
    return raw + b" " * (-(_PREFIX.size + len(raw)) % PAYLOAD_ALIGN)


def _unpack(data: bytes | bytearray | memoryview, kind: str, job: str | None,
            step: int | None) -> tuple[dict[str, Any], memoryview]:
    """The header and a view of the payload (slicing bytes would copy a model-sized vector)."""
    data = memoryview(data).cast("B")
    if len(data) < _PREFIX.size:
        raise WireError(f"truncated: {len(data)} bytes is shorter than the header")
    magic, version, hlen, crc = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise WireError(f"bad magic {magic!r}: not a Phalanx wire message")
    if version != VERSION:
        raise WireError(f"unsupported wire version {version} (this side speaks {VERSION})")
    if hlen > MAX_HEADER or _PREFIX.size + hlen > len(data):
        raise WireError(f"truncated: header of {hlen} bytes does not fit in {len(data)} bytes")
    raw = bytes(data[_PREFIX.size : _PREFIX.size + hlen])
    payload = data[_PREFIX.size + hlen :]
    if crc32(payload, crc32(raw)) != crc:
        raise WireError("checksum mismatch: the message was corrupted or truncated")
    try:
        header = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, UnicodeDecodeError) as exc:
        raise WireError(f"header is not valid JSON: {exc}") from None
    if not isinstance(header, dict):
        raise WireError("header must be a JSON object")
    if header.get("kind") != kind:
        raise WireError(f"expected a {kind} message, got {header.get('kind')!r}")
    if not isinstance(header.get("job"), str) or not _is_int(header.get("step")):
        raise WireError("header needs a string job and an integer step")
    if job is not None and header["job"] != job:
        raise WireError(f"message is for job {header['job']!r}, expected {job!r}")
    if step is not None and header["step"] != step:
        raise WireError(f"message is for step {header['step']}, expected {step}")
    return header, payload


def _shard_entries(header: dict[str, Any]) -> list[dict[str, Any]]:
    shards = header.get("shards")
    if not isinstance(shards, list) or not shards:
        raise WireError("results header needs a non-empty shards list")
    ranges: list[tuple[int, int]] = []
    for meta in shards:
        if not isinstance(meta, dict) or not all(_is_int(meta.get(k)) for k in
                                                 ("shard", "correct", "count")):
            raise WireError("each shard entry needs integer shard, correct and count")
        loss = meta.get("loss_sum")
        if isinstance(loss, bool) or not isinstance(loss, (int, float)) or not math.isfinite(loss):
            raise WireError(f"shard {meta['shard']}: loss_sum must be a finite number")
        span = meta.get("span", 1)
        if not _is_int(span) or span < 1:
            raise WireError(f"shard {meta['shard']}: span must be an integer >= 1")
        if meta["shard"] < 0:
            raise WireError(f"shard {meta['shard']} is negative")
        if meta["count"] < 1 or not 0 <= meta["correct"] <= meta["count"]:
            raise WireError(f"shard {meta['shard']}: count must be >= 1 and correct in 0..count")
        ranges.append((meta["shard"], meta["shard"] + span))
    ranges.sort()
    for (lo, hi), (next_lo, _) in zip(ranges, ranges[1:]):
        if next_lo < hi:  # (ranges, not their shards: a span may be anything a client sends)
            raise WireError(f"shard {next_lo} is listed twice (in the results from {lo})")
    return shards


def _count(header: dict[str, Any], key: str, expected: int | None) -> int:
    value = header.get(key)
    if not _is_int(value) or value < 0:
        raise WireError(f"header field {key} must be a non-negative integer")
    if expected is not None and value != expected:
        raise WireError(f"{key} is {value}, this model has {expected}")
    return value


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _reject_constant(name: str) -> Any:
    raise WireError(f"header holds {name}: numbers must be finite")


def _f32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype="<f4")


def all_finite(a: np.ndarray) -> bool:
    """No NaN or infinity in `a`. A sum is NaN or infinite whenever an element is, so a finite
    sum settles it in one pass with no temporary; only a non-finite sum (which finite values
    can also give, by overflow) needs the element-wise check. Not BLAS's dot (2.5x faster
    alone): its threads spin after each call, and the server's upload threads paid ~25 ms of
    CPU a step for it (bench/scheduler_coordination.py, docs/benchmarks.md)."""
    with np.errstate(over="ignore", invalid="ignore"):
        if np.isfinite(np.add.reduce(a, axis=None)):
            return True
    return bool(np.isfinite(a).all())


def _finite(a: np.ndarray, what: str) -> np.ndarray:
    if not all_finite(a):
        raise WireError(f"{what} holds NaN or infinity")
    return a
