"""Stored shard results: references into the upload as it arrived, or whole results."""

from __future__ import annotations

import numpy as np
import pytest

from engine.step import ShardResult
from hotstate import keys
from hotstate.blobs import MemoryBlobStore
from hotstate.gradstore import (
    GradBlobError,
    body_key_of,
    offset_in,
    pack_ref,
    pack_result,
    stored_nodes,
    unpack,
    uploaded_shards,
)
from wire.messages import decode_results, encode_results


def _results(dtype: str = "float32") -> tuple[bytearray, list[ShardResult]]:
    rng = np.random.default_rng(0)
    sent = [ShardResult(k, rng.standard_normal(300).astype(np.float32), 1.5 + k, 2, 4,
                        rng.standard_normal(6).astype(np.float32)) for k in (2, 5)]
    body = bytearray(encode_results("j", 0, sent, dtype=dtype))
    return body, decode_results(body)


def test_a_reference_reads_the_shards_arrays_from_the_stored_body_without_a_copy() -> None:
    body, results = _results()
    store = MemoryBlobStore()
    store.set("body", body)
    kept = store.get("body")
    for r in results:
        ref = pack_ref(r, "body", offset_in(r.grad_sum, body), offset_in(r.stats, body))
        assert body_key_of(ref) == "body" and len(ref) < 128  # small, whatever the model
        back = unpack(ref, 300, 6, kept)
        assert (back.shard, back.loss_sum, back.correct, back.count) == (
            r.shard, r.loss_sum, r.correct, r.count)
        assert back.grad_sum.tobytes() == r.grad_sum.tobytes()
        assert back.stats.tobytes() == r.stats.tobytes()
        assert np.shares_memory(back.grad_sum, np.frombuffer(kept, np.uint8))  # no copy
        assert not back.grad_sum.flags.writeable  # the store's value is read-only


def test_a_widened_float16_result_is_not_in_the_body_and_is_stored_whole() -> None:
    body, results = _results("float16")
    assert offset_in(results[0].grad_sum, body) is None  # widened into a new array
    whole = pack_result(results[0])
    assert body_key_of(whole) is None
    assert unpack(whole, 300, 6).grad_sum.tobytes() == results[0].grad_sum.tobytes()


def test_a_reference_whose_body_is_gone_or_short_is_refused() -> None:
    body, results = _results()
    r = results[1]
    ref = pack_ref(r, "body", offset_in(r.grad_sum, body), offset_in(r.stats, body))
    with pytest.raises(GradBlobError, match="gone or too short"):
        unpack(ref, 300, 6, None)
    with pytest.raises(GradBlobError, match="gone or too short"):
        unpack(ref, 300, 6, bytes(body[:100]))
    with pytest.raises(GradBlobError, match="does not fit"):
        unpack(ref, 301, 6, body)
    with pytest.raises(GradBlobError, match="wrong length"):
        body_key_of(ref[:-1])


def test_a_state_blob_filled_in_place_is_byte_for_byte_encode_state() -> None:
    from engine.step import TrainState
    from hotstate.trainstate import StateBlob, decode_state, encode_state

    rng = np.random.default_rng(1)
    state = TrainState(4, rng.standard_normal(50).astype(np.float32),
                       rng.standard_normal(50).astype(np.float32),
                       rng.standard_normal(7).astype(np.float32))
    blob = StateBlob(4, 50, 7)
    blob.params[:], blob.opt_state[:], blob.buffers[:] = state.params, state.opt_state, state.buffers
    assert bytes(blob.data) == encode_state(state)
    back = decode_state(memoryview(blob.data).toreadonly(), expect_step=4)
    assert back.opt_state.tobytes() == state.opt_state.tobytes()


def test_stored_nodes_read_shards_and_partials_and_skip_what_is_no_range() -> None:
    """The apply step adds whatever cover is stored: each key names its shard range; a key
    under the step's prefix that names no node of the tree (a stray, a reversed or empty
    range, digits int() would refuse) is not a result and must not make a shard look
    uploaded."""
    blobs = MemoryBlobStore()
    for key in (keys.grad("j", 3, 0), keys.grad("j", 3, 4, 4)):
        blobs.set(key, b"x")
    prefix = keys.grad_prefix("j", 3)
    for stray in ("2-2", "5-1", "²", "1-²", "x", "-3"):
        blobs.set(prefix + stray, b"x")
    assert set(stored_nodes(blobs, "j", 3, 8)) == {(0, 1), (4, 8)}
    assert uploaded_shards(blobs, "j", 3, 8) == {0, 4, 5, 6, 7}


def test_state_and_whole_result_blobs_hold_their_arrays_aligned_and_older_ones_still_read() -> None:
    """apply_step reads one state blob and writes the next in place: arrays at an unaligned
    offset go through numpy's buffered copies. Version 3 state blobs and G2 results put their
    arrays at byte 64; blobs an older replica wrote (S2, G1) read back the same."""
    import struct

    from engine.step import TrainState
    from hotstate.trainstate import StateBlob, decode_state, encode_state

    rng = np.random.default_rng(2)
    state = TrainState(3, rng.standard_normal(50).astype(np.float32),
                       rng.standard_normal(100).astype(np.float32),
                       rng.standard_normal(7).astype(np.float32))
    blob = StateBlob(3, 50, 7, slots=2)
    assert blob.params.ctypes.data % 16 == 0
    assert blob.opt_state.flags.aligned and blob.buffers.flags.aligned
    new = decode_state(encode_state(state))
    assert new.params.flags.aligned and new.opt_state.flags.aligned
    arrays = b"".join(a.tobytes() for a in (state.params, state.opt_state, state.buffers))
    older = decode_state(struct.pack("<6sQQQQ", b"PHLXS2", 3, 50, 7, 2) + arrays, expect_step=3)
    oldest = decode_state(struct.pack("<6sQQQ", b"PHLXS1", 3, 50, 7) + arrays[:4 * 100]
                          + state.buffers.tobytes())
    for got in (new, older):
        assert [got.params.tobytes(), got.opt_state.tobytes(), got.buffers.tobytes()] == \
            [state.params.tobytes(), state.opt_state.tobytes(), state.buffers.tobytes()]
    assert oldest.opt_state.tobytes() == state.opt_state[:50].tobytes()

    result = ShardResult(4, rng.standard_normal(300).astype(np.float32), 2.5, 3, 4,
                         rng.standard_normal(6).astype(np.float32))
    whole = unpack(pack_result(result), 300, 6)
    assert whole.grad_sum.flags.aligned and whole.stats.flags.aligned
    g1 = struct.pack("<6sIdqqQQ", b"PHLXG1", 4, 2.5, 3, 4, 300, 6) + \
        result.grad_sum.tobytes() + result.stats.tobytes()
    for got in (whole, unpack(g1, 300, 6)):
        assert (got.shard, got.loss_sum, got.correct, got.count) == (4, 2.5, 3, 4)
        assert got.grad_sum.tobytes() == result.grad_sum.tobytes()
        assert got.stats.tobytes() == result.stats.tobytes()
