"""How one shard's result sits in the blob store between its upload and apply_step.

The upload route has already checked the agent's message (checksum, sizes, finite values), so
apply_step reads the float32 arrays as views, without a second checksum, finiteness pass or
copy. Two forms under a shard's key:

- a *reference* (`pack_ref`): a fixed header naming the upload's body key and where the shard's
  arrays sit in it. The upload is stored once as it arrived, so accepting a 12.9 MB result
  copies nothing (a copy held the GIL for 1-14 ms per upload, longer when its pages were new);
- the *whole* result (`pack_result`): header and arrays, for results that are not float32
  arrays of the message (a float16 upload is widened into new arrays).

`unpack` reads either; a reference needs its body, fetched by the caller (`body_key_of`).
"""

from __future__ import annotations

import struct
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

from engine import tree
from engine.step import ShardResult
from hotstate import keys
from hotstate.blobs import BlobStore

# G2 pads the header to 64 bytes so the arrays are read aligned (numpy reads an unaligned
# float32 view through a buffered copy); G1 (50 bytes) is still read
MAGIC = b"PHLXG2"
_HEADER = struct.Struct("<6sIdqqQQ14x")  # magic, shard, loss_sum, correct, count, n_params, n_stats
MAGIC_V1 = b"PHLXG1"
_HEADER_V1 = struct.Struct("<6sIdqqQQ")
REF_MAGIC = b"PHLXR1"
_REF = struct.Struct("<6sIdqqQQQQH")  # ... then grad offset, stats offset, body key length


class GradBlobError(ValueError):
    pass


def pack_result(result: ShardResult) -> bytes:
    grad = np.ascontiguousarray(result.grad_sum, dtype="<f4")
    stats = np.ascontiguousarray(result.stats, dtype="<f4")
    head = _HEADER.pack(MAGIC, int(result.shard), float(result.loss_sum), int(result.correct),
                        int(result.count), grad.size, stats.size)
    return b"".join((head, memoryview(grad).cast("B"), memoryview(stats).cast("B")))


def unpack_result(data: bytes, n_params: int, n_stats: int) -> ShardResult:
    header = _HEADER_V1 if bytes(data[:6]) == MAGIC_V1 else _HEADER
    if len(data) < header.size:
        raise GradBlobError("gradient blob is truncated")
    magic, shard, loss_sum, correct, count, p, s = header.unpack_from(data)
    if magic not in (MAGIC, MAGIC_V1) or p != n_params or s != n_stats:
        raise GradBlobError("gradient blob does not fit this job's model")
    if len(data) != header.size + 4 * (p + s):
        raise GradBlobError("gradient blob has the wrong length")
    flat = np.frombuffer(data, dtype="<f4", offset=header.size)
    return ShardResult(int(shard), flat[:p], float(loss_sum), int(correct), int(count), flat[p:])


def offset_in(view: np.ndarray, body: bytes | bytearray | memoryview) -> int | None:
    """Where `view`'s data starts in `body`, or None when it is not a float32 view of it."""
    if view.dtype != np.dtype("<f4") or not view.flags.c_contiguous:
        return None
    start = np.frombuffer(body, np.uint8).__array_interface__["data"][0]
    offset = view.__array_interface__["data"][0] - start
    return offset if 0 <= offset and offset + view.nbytes <= len(body) else None


def pack_ref(result: ShardResult, body_key: str, grad_offset: int, stats_offset: int) -> bytes:
    key = body_key.encode()
    head = _REF.pack(REF_MAGIC, int(result.shard), float(result.loss_sum), int(result.correct),
                     int(result.count), result.grad_sum.size, result.stats.size, grad_offset,
                     stats_offset, len(key))
    return head + key


@dataclass(frozen=True)
class Ref:
    """A reference's header: where a result's arrays sit in the body it names."""

    body_key: str
    loss_sum: float
    correct: int
    count: int
    grad_offset: int
    stats_offset: int


def read_ref(data: bytes | memoryview, n_params: int, n_stats: int) -> Ref | None:
    """A reference's header; None for a whole result (`unpack` reads it)."""
    body_key = body_key_of(data)
    if body_key is None:
        return None
    _, _, loss_sum, correct, count, p, s, g_off, s_off, _ = _REF.unpack_from(data)
    if p != n_params or s != n_stats:
        raise GradBlobError("gradient reference does not fit this job's model")
    return Ref(body_key, float(loss_sum), int(correct), int(count), int(g_off), int(s_off))


def body_key_of(data: bytes | memoryview) -> str | None:
    """The body key a reference names; None for a whole result."""
    if len(data) < _REF.size or bytes(data[:6]) != REF_MAGIC:
        return None
    key_len = _REF.unpack_from(data)[-1]
    if len(data) != _REF.size + key_len:
        raise GradBlobError("gradient reference has the wrong length")
    return bytes(data[_REF.size:]).decode()


def unpack(data: bytes | memoryview, n_params: int, n_stats: int,
           body: bytes | memoryview | None = None) -> ShardResult:
    """A stored shard result of either form (`body`: what a reference's body key holds)."""
    if body_key_of(data) is None:
        return unpack_result(data, n_params, n_stats)
    _, shard, loss_sum, correct, count, p, s, g_off, s_off, _ = _REF.unpack_from(data)
    if p != n_params or s != n_stats:
        raise GradBlobError("gradient reference does not fit this job's model")
    if body is None or g_off + 4 * p > len(body) or s_off + 4 * s > len(body):
        raise GradBlobError("the upload a gradient reference names is gone or too short")
    grad = np.frombuffer(body, dtype="<f4", count=p, offset=g_off)
    stats = np.frombuffer(body, dtype="<f4", count=s, offset=s_off)
    return ShardResult(int(shard), grad, float(loss_sum), int(correct), int(count), stats)


def stored_nodes(blobs: BlobStore, job_id: str, step: int, shards: int,
                 over: Collection[int] | None = None) -> dict[tuple[int, int], str]:
    """Every stored result of the step, shard's or partial's: its shard range -> its key
    (`over`: only those holding one of these shards). Asked of the tree's possible keys in one
    round trip, not listed by prefix: a listing walks the whole keyspace (SCAN), which grows
    with the fleet, and every upload and work answer asks."""
    candidates = {node: keys.grad(job_id, step, node[0], node[1] - node[0])
                  for node in tree.nodes(shards, over)}
    there = blobs.which_exist(list(candidates.values()))
    return {node: key for (node, key), found in zip(candidates.items(), there) if found}


def audit_nodes(blobs: BlobStore, job_id: str, step: int, shards: int,
                node: tuple[int, int], role: str) -> dict[tuple[int, int], str]:
    """The results stored for an audit of `node` as `role` (keys.audit): the node itself, or
    the parts of it an auditor uploaded apart; their ranges -> their keys (one round trip)."""
    lo, hi = node
    candidates = {n: keys.audit(job_id, step, n[0], n[1] - n[0], role)
                  for n in tree.nodes(shards, range(lo, hi)) if lo <= n[0] and n[1] <= hi}
    there = blobs.which_exist(list(candidates.values()))
    return {n: key for (n, key), found in zip(candidates.items(), there) if found}


def audited_shards(blobs: BlobStore, job_id: str, step: int, shards: int,
                   node: tuple[int, int], role: str) -> set[int]:
    """The shards of `node` that stored audit results (as `role`) cover."""
    return {k for lo, hi in audit_nodes(blobs, job_id, step, shards, node, role)
            for k in range(lo, hi)}


def covered_at_most(blobs: BlobStore, job_id: str, step: int, stored: int) -> int:
    """Count `stored` more shards in the results stored for the step (called after storing
    them); the new count, an upper bound on the shards the step's results cover: each result
    adds its size once, so overlapping results (a backup's and its primary's) and results
    deleted since only make it larger. Below the job's shard count the step is certainly not
    complete, so an upload need not ask which results are stored (O(shards) keys, and every
    upload of a step would ask)."""
    return blobs.incr(keys.covered(job_id, step), stored)


def uploaded_shards(blobs: BlobStore, job_id: str, step: int, shards: int,
                    over: Collection[int] | None = None) -> set[int]:
    """The shards some stored result covers (`over`: of these shards)."""
    found = {k for lo, hi in stored_nodes(blobs, job_id, step, shards, over)
             for k in range(lo, hi)}
    return found if over is None else found & set(over)
