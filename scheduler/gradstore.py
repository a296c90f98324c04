"""How one shard's result sits in the blob store between its upload and apply_step.

The upload route has already checked the agent's message (checksum, sizes, finite values), so
the stored form is a fixed header and the raw float32 arrays: apply_step reads them as views
of the blob, without a second checksum, finiteness pass or copy.
"""

from __future__ import annotations

import struct

import numpy as np

from agent.nn.step import ShardResult

MAGIC = b"PHLXG1"
_HEADER = struct.Struct("<6sIdqqQQ")  # magic, shard, loss_sum, correct, count, n_params, n_stats


class GradBlobError(ValueError):
    pass


def pack_result(result: ShardResult) -> bytes:
    grad = np.ascontiguousarray(result.grad_sum, dtype="<f4")
    stats = np.ascontiguousarray(result.stats, dtype="<f4")
    head = _HEADER.pack(MAGIC, int(result.shard), float(result.loss_sum), int(result.correct),
                        int(result.count), grad.size, stats.size)
    return b"".join((head, memoryview(grad).cast("B"), memoryview(stats).cast("B")))


def unpack_result(data: bytes, n_params: int, n_stats: int) -> ShardResult:
    if len(data) < _HEADER.size:
        raise GradBlobError("gradient blob is truncated")
    magic, shard, loss_sum, correct, count, p, s = _HEADER.unpack_from(data)
    if magic != MAGIC or p != n_params or s != n_stats:
        raise GradBlobError("gradient blob does not fit this job's model")
    if len(data) != _HEADER.size + 4 * (p + s):
        raise GradBlobError("gradient blob has the wrong length")
    flat = np.frombuffer(data, dtype="<f4", offset=_HEADER.size)
    return ShardResult(int(shard), flat[:p], float(loss_sum), int(correct), int(count), flat[p:])
