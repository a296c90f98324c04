"""Encoding of a job's training state in the blob store (weights + optimizer state + buffers).

A small fixed header then raw little-endian float32 arrays: no pickle, no per-array zip entry,
so a 3.2M-parameter state encodes and decodes at memory speed. The optimizer state is `slots`
vectors of n_params (SGD's momentum; AdamW's two moments). Version 1 blobs (before AdamW: one
momentum vector, a header without `slots`) still decode, so a job runs on across the upgrade.
"""

from __future__ import annotations

import struct

import numpy as np

from engine.step import TrainState
from hotstate import keys
from hotstate.blobs import BlobStore
from wire.buffers import new_buffer

# version 3 pads the header to 64 bytes: numpy reads and writes the arrays of a blob at an
# unaligned offset through buffered copies (apply_step reads one state and writes the next)
MAGIC = b"PHLXS3"
_HEADER = struct.Struct("<6sQQQQ26x")  # magic, step, n_params, n_buffers, slots, padding
MAGIC_V2 = b"PHLXS2"
_HEADER_V2 = struct.Struct("<6sQQQQ")  # magic, step, n_params, n_buffers, slots
MAGIC_V1 = b"PHLXS1"
_HEADER_V1 = struct.Struct("<6sQQQ")  # magic, step, n_params, n_buffers (one slot)


class StateError(ValueError):
    pass


class StateBlob:
    """A state blob whose arrays are filled in place (apply_step writes the new optimizer state
    straight into it); byte for byte what `encode_state` makes of the same arrays."""

    def __init__(self, step: int, n_params: int, n_buffers: int, slots: int = 1) -> None:
        self.data = new_buffer(_HEADER.size + 4 * ((1 + slots) * n_params + n_buffers))
        _HEADER.pack_into(self.data, 0, MAGIC, int(step), n_params, n_buffers, slots)
        flat = np.frombuffer(self.data, dtype="<f4", offset=_HEADER.size)
        self.params = flat[:n_params]
        self.opt_state = flat[n_params:(1 + slots) * n_params]
        self.buffers = flat[(1 + slots) * n_params:]


def encode_state(state: TrainState) -> bytes:
    params = np.ascontiguousarray(state.params, dtype="<f4")
    opt_state = np.ascontiguousarray(state.opt_state, dtype="<f4")
    buffers = np.ascontiguousarray(state.buffers, dtype="<f4")
    slots, rest = divmod(opt_state.size, max(params.size, 1))
    if rest or not slots:
        raise StateError("the optimizer state is not a whole number of parameter vectors")
    head = _HEADER.pack(MAGIC, int(state.step), params.size, buffers.size, slots)
    return b"".join((head, *(memoryview(a).cast("B") for a in (params, opt_state, buffers))))


def _header(data: bytes) -> tuple[int, int, int, int, int] | None:
    """(header size, step, n_params, n_buffers, slots) of any version, or None."""
    for magic, struct_ in ((MAGIC, _HEADER), (MAGIC_V2, _HEADER_V2)):
        if data[:6] == magic and len(data) >= struct_.size:
            _, step, n_params, n_buffers, slots = struct_.unpack_from(data)
            return struct_.size, step, n_params, n_buffers, slots
    if data[:6] == MAGIC_V1 and len(data) >= _HEADER_V1.size:
        _, step, n_params, n_buffers = _HEADER_V1.unpack_from(data)
        return _HEADER_V1.size, step, n_params, n_buffers, 1
    return None


def read_weights(blobs: BlobStore, key: str, expect_step: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The params and buffers of the state under `key`, read by range (its header, then the
    two arrays: not the optimizer state, a third of the blob or more); None when it is gone or
    changed meanwhile."""
    head = _header(bytes(blobs.get_range(key, 0, _HEADER.size)))
    if head is None:
        return None
    size, step, n_params, n_buffers, slots = head
    if step != expect_step:
        return None
    params = blobs.get_range(key, size, 4 * n_params)
    buffers = blobs.get_range(key, size + 4 * (1 + slots) * n_params, 4 * n_buffers)
    if len(params) != 4 * n_params or len(buffers) != 4 * n_buffers:
        return None
    return np.frombuffer(params, "<f4"), np.frombuffer(buffers, "<f4")


def decode_state(data: bytes, expect_step: int | None = None) -> TrainState:
    head = _header(data)
    if head is None:
        raise StateError("not a Phalanx state blob (or truncated)")
    size, step, n_params, n_buffers, slots = head
    if len(data) != size + 4 * ((1 + slots) * n_params + n_buffers):
        raise StateError("state blob has the wrong length")
    if expect_step is not None and step != expect_step:
        raise StateError(f"state blob is for step {step}, expected {expect_step}")
    flat = np.frombuffer(data, dtype="<f4", offset=size)
    params = flat[:n_params]
    opt_state = flat[n_params : (1 + slots) * n_params]
    buffers = flat[(1 + slots) * n_params :]
    # read-only views of the blob: apply_step builds new arrays, never writes in place
    return TrainState(int(step), params, opt_state, buffers)


def state_stored(blobs: BlobStore, job_id: str, step: int, nonce: str | None,
                 slices: int) -> bool:
    """Whether every key the state of `step` is stored under exists (a sliced state's slices
    are written by separate tasks: one can be lost alone)."""
    names = keys.state_keys(job_id, step, nonce, slices)
    return blobs.count_existing(names) == len(names)
