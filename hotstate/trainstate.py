"""Encoding of a job's training state in the blob store (weights + momentum + buffers).

A small fixed header then raw little-endian float32 arrays: no pickle, no per-array zip entry,
so a 3.2M-parameter state encodes and decodes at memory speed.
"""

from __future__ import annotations

import struct

import numpy as np

from engine.step import TrainState
from hotstate.blobs import BlobStore
from wire.messages import new_buffer

MAGIC = b"PHLXS1"
_HEADER = struct.Struct("<6sQQQ")


class StateError(ValueError):
    pass


class StateBlob:
    """A state blob whose arrays are filled in place (apply_step writes the new momentum
    straight into it); byte for byte what `encode_state` makes of the same arrays."""

    def __init__(self, step: int, n_params: int, n_buffers: int) -> None:
        self.data = new_buffer(_HEADER.size + 4 * (2 * n_params + n_buffers))
        _HEADER.pack_into(self.data, 0, MAGIC, int(step), n_params, n_buffers)
        flat = np.frombuffer(self.data, dtype="<f4", offset=_HEADER.size)
        self.params = flat[:n_params]
        self.momentum = flat[n_params:2 * n_params]
        self.buffers = flat[2 * n_params:]


def encode_state(state: TrainState) -> bytes:
    params = np.ascontiguousarray(state.params, dtype="<f4")
    momentum = np.ascontiguousarray(state.momentum, dtype="<f4")
    buffers = np.ascontiguousarray(state.buffers, dtype="<f4")
    if momentum.size != params.size:
        raise StateError("momentum and params differ in size")
    head = _HEADER.pack(MAGIC, int(state.step), params.size, buffers.size)
    return b"".join((head, *(memoryview(a).cast("B") for a in (params, momentum, buffers))))


def read_weights(blobs: BlobStore, key: str, expect_step: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The params and buffers of the state under `key`, read by range (its header, then the
    two arrays: not the momentum, a third of the blob); None when it is gone or changed
    meanwhile."""
    head = bytes(blobs.get_range(key, 0, _HEADER.size))
    if len(head) != _HEADER.size:
        return None
    magic, step, n_params, n_buffers = _HEADER.unpack(head)
    if magic != MAGIC or step != expect_step:
        return None
    params = blobs.get_range(key, _HEADER.size, 4 * n_params)
    buffers = blobs.get_range(key, _HEADER.size + 8 * n_params, 4 * n_buffers)
    if len(params) != 4 * n_params or len(buffers) != 4 * n_buffers:
        return None
    return np.frombuffer(params, "<f4"), np.frombuffer(buffers, "<f4")


def decode_state(data: bytes, expect_step: int | None = None) -> TrainState:
    if len(data) < _HEADER.size:
        raise StateError("state blob is truncated")
    magic, step, n_params, n_buffers = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise StateError("not a Phalanx state blob")
    if len(data) != _HEADER.size + 4 * (2 * n_params + n_buffers):
        raise StateError("state blob has the wrong length")
    if expect_step is not None and step != expect_step:
        raise StateError(f"state blob is for step {step}, expected {expect_step}")
    flat = np.frombuffer(data, dtype="<f4", offset=_HEADER.size)
    params = flat[:n_params]
    momentum = flat[n_params : 2 * n_params]
    buffers = flat[2 * n_params :]
    # read-only views of the blob: apply_step builds new arrays, never writes in place
    return TrainState(int(step), params, momentum, buffers)
