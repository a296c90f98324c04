"""The wire format round-trips exactly and refuses every kind of damage, saying which."""

from __future__ import annotations

import json
import struct
import zlib

import numpy as np
import pytest

from engine.step import ShardResult
from wire.assignment import Assignment
from wire.messages import (
    MAGIC,
    WireError,
    decode_results,
    decode_weights,
    encode_results,
    encode_results_parts,
    encode_weights,
    join_weights,
)

RNG = np.random.default_rng(0)
PARAMS = RNG.standard_normal(1000).astype(np.float32)
BUFFERS = RNG.standard_normal(40).astype(np.float32)


def _results(n=3) -> list[ShardResult]:
    return [ShardResult(k, RNG.standard_normal(1000).astype(np.float32), 12.5 + k, 7, 16,
                        RNG.standard_normal(40).astype(np.float32)) for k in (4, 1, 9)[:n]]


def _rebuild(data: bytes, edit) -> bytes:
    """Re-pack a message with its header edited and a correct checksum."""
    _, version, hlen, _ = struct.unpack_from("<5sHII", data)
    header = json.loads(data[15 : 15 + hlen])
    payload = data[15 + hlen :]
    edit(header)
    raw = json.dumps(header).encode()
    crc = zlib.crc32(payload, zlib.crc32(raw))
    return struct.pack("<5sHII", MAGIC, version, len(raw), crc) + raw + payload


def test_weights_round_trip_bit_exactly():
    step, p, b = decode_weights(encode_weights("job-1", 7, PARAMS, BUFFERS), "job-1", 7, 1000, 40)
    assert step == 7 and p.tobytes() == PARAMS.tobytes() and b.tobytes() == BUFFERS.tobytes()


def test_results_round_trip_in_float32_and_float16():
    sent = _results()
    got = decode_results(encode_results("job-1", 3, sent), "job-1", 3, 1000, 40)
    for a, b in zip(sent, got):
        assert (a.shard, a.loss_sum, a.correct, a.count) == (b.shard, b.loss_sum, b.correct,
                                                             b.count)
        assert a.grad_sum.tobytes() == b.grad_sum.tobytes()
        assert a.stats.tobytes() == b.stats.tobytes()
    half = decode_results(encode_results("job-1", 3, sent, dtype="float16"))
    np.testing.assert_allclose(half[0].grad_sum, sent[0].grad_sum, rtol=1e-3, atol=1e-3)
    assert half[0].stats.tobytes() == sent[0].stats.tobytes()  # stats stay float32
    assert len(encode_results("j", 3, sent, "float16")) < len(encode_results("j", 3, sent))


GOOD_W = encode_weights("job-1", 7, PARAMS, BUFFERS)
GOOD_R = encode_results("job-1", 3, _results())


@pytest.mark.parametrize(("data", "kwargs", "needle"), [
    (b"", {}, "truncated"),
    (GOOD_W[:10], {}, "truncated"),
    (GOOD_W[:-4], {}, "checksum"),
    (b"NOTPX" + GOOD_W[5:], {}, "bad magic"),
    (GOOD_W[:5] + struct.pack("<H", 9) + GOOD_W[7:], {}, "version 9"),
    (GOOD_W[:-1] + bytes([GOOD_W[-1] ^ 1]), {}, "checksum"),
    (GOOD_W, {"expect_job": "job-2"}, "job 'job-1', expected 'job-2'"),
    (GOOD_W, {"expect_step": 8}, "step 7, expected 8"),
    (GOOD_W, {"n_params": 999}, "n_params is 1000, this model has 999"),
    (GOOD_R, {}, "expected a weights message"),
    (_rebuild(GOOD_W, lambda h: h.update(n_params=1001)), {}, "payload is"),
    (_rebuild(GOOD_W, lambda h: h.update(dtype="float64")), {}, "dtype"),
    (_rebuild(GOOD_W, lambda h: h.update(step="7")), {}, "integer step"),
    (encode_weights("job-1", 7, np.array([1.0, np.nan], np.float32), BUFFERS), {}, "NaN"),
])
def test_malformed_weights_are_refused(data, kwargs, needle):
    with pytest.raises(WireError, match=needle):
        decode_weights(data, **kwargs)


def _shard_edit(**change):
    return lambda h: h["shards"][0].update(change)


@pytest.mark.parametrize(("data", "kwargs", "needle"), [
    (GOOD_R[:-100], {}, "checksum"),
    (GOOD_W, {}, "expected a results message"),
    (GOOD_R, {"n_stats": 41}, "n_stats is 40, this model has 41"),
    (GOOD_R, {"expect_step": 4}, "step 3, expected 4"),
    (_rebuild(GOOD_R, lambda h: h["shards"].pop()), {}, "payload is"),
    (_rebuild(GOOD_R, _shard_edit(shard=1)), {}, "listed twice"),
    # shard 4 claiming shards 4..9 (a partial) overlaps shard 9's own entry
    (_rebuild(GOOD_R, _shard_edit(span=6)), {}, "shard 9 is listed twice"),
    # a span is a range, never expanded: a huge one is refused at once, not enumerated
    (_rebuild(GOOD_R, _shard_edit(span=10**15)), {}, "listed twice"),
    (_rebuild(GOOD_R, _shard_edit(span=0)), {}, "span must be an integer >= 1"),
    (_rebuild(GOOD_R, _shard_edit(span=True)), {}, "span must be"),
    (_rebuild(GOOD_R, _shard_edit(correct=17)), {}, "correct in 0..count"),
    (_rebuild(GOOD_R, _shard_edit(loss_sum="x")), {}, "loss_sum"),
    (_rebuild(GOOD_R, lambda h: h.update(dtype="int8")), {}, "dtype"),
    (_rebuild(GOOD_R, lambda h: h.update(shards=[])), {}, "non-empty shards"),
])
def test_malformed_results_are_refused(data, kwargs, needle):
    with pytest.raises(WireError, match=needle):
        decode_results(data, **kwargs)


def test_non_finite_results_are_refused_on_both_sides():
    bad = _results(1)
    bad[0].grad_sum[3] = np.inf
    with pytest.raises(WireError, match="not finite"):
        encode_results("job-1", 0, bad)
    big = _results(1)
    big[0].grad_sum[0] = 1e6  # beyond float16's range
    with pytest.raises(WireError, match="float16"):
        encode_results("job-1", 0, big, dtype="float16")
    nan_loss = _results(1)
    nan_loss[0].loss_sum = float("nan")
    with pytest.raises(WireError, match="NaN"):
        encode_results("job-1", 0, nan_loss)
    body = _rebuild(encode_results("job-1", 0, _results(1)), _shard_edit(loss_sum=1.0))
    raw = bytearray(body)
    raw[-4:] = np.array([np.nan], "<f4").tobytes()  # a stat turned NaN, checksum refreshed
    _, version, hlen, _ = struct.unpack_from("<5sHII", raw)
    crc = zlib.crc32(bytes(raw[15 + hlen :]), zlib.crc32(bytes(raw[15 : 15 + hlen])))
    raw[11:15] = struct.pack("<I", crc)
    with pytest.raises(WireError, match="stats holds NaN"):
        decode_results(bytes(raw))


@pytest.mark.parametrize("values, finite", [
    ([0.0, 1.0, -2.5], True),
    ([], True),
    ([3e38, 3e38, -1.0], True),  # the sum overflows; every element is finite
    ([1.0, np.nan, 2.0], False),
    ([1.0, np.inf], False),
    ([np.inf, -np.inf], False),  # the sum is NaN
    ([-np.inf, 0.0], False),
])
@pytest.mark.parametrize("dtype", ["float32", "float16", "float64"])
def test_all_finite_agrees_with_the_element_wise_check(values, finite, dtype):
    from wire.messages import all_finite

    with np.errstate(over="ignore"):
        a = np.array(values, dtype=np.float64).astype(dtype)
    assert all_finite(a) is bool(np.isfinite(a).all())
    if dtype != "float16":  # 3e38 is inf in float16
        assert all_finite(a) is finite


def test_float32_results_decode_as_views_of_the_message_and_refuse_writes():
    body = encode_results("job-1", 3, [ShardResult(0, np.arange(1000, dtype=np.float32), 1.0, 0,
                                                   4, np.zeros(40, np.float32))])
    got = decode_results(body, "job-1", 3, 1000, 40)[0]
    np.testing.assert_array_equal(got.grad_sum, np.arange(1000, dtype=np.float32))
    with pytest.raises(ValueError):
        got.grad_sum[0] = 1.0  # a view of the (immutable) upload: nothing can change it


def test_the_checksum_is_zlibs_crc32_whichever_implementation_computes_it():
    """The control plane computes CRC-32 with zlib-ng where installed, a phone with the
    standard library: both must produce and accept the same messages."""
    from wire import messages as wire

    grad = np.arange(1000, dtype=np.float32)
    body = encode_results("j", 3, [ShardResult(0, grad, 1.0, 1, 2, np.zeros(4, np.float32))])
    magic, version, hlen, crc = struct.unpack_from("<5sHII", body)
    assert crc == zlib.crc32(body[15:])  # what a phone's stdlib zlib computes
    # a message checksummed by the standard library decodes here, and a flipped bit does not
    assert decode_results(body)[0].grad_sum.tolist() == grad.tolist()
    assert wire.crc32(body[15:]) == zlib.crc32(body[15:])
    broken = bytearray(body)
    broken[-5] ^= 1
    with pytest.raises(WireError, match="checksum"):
        decode_results(bytes(broken))


def test_a_weights_message_filled_in_place_is_byte_for_byte_encode_weights():
    from wire.messages import WeightsMessage

    msg = WeightsMessage("job-x", 7, PARAMS.size, BUFFERS.size)
    msg.params[:] = PARAMS
    msg.buffers[:] = BUFFERS
    assert bytes(msg.seal()) == encode_weights("job-x", 7, PARAMS, BUFFERS)
    step, params, buffers = decode_weights(bytes(msg.data), expect_job="job-x", expect_step=7)
    assert step == 7 and params.tobytes() == PARAMS.tobytes()


@pytest.mark.parametrize("combine", [True, False])
def test_a_weights_message_taken_a_block_at_a_time_by_threads_is_encode_weights_and_says_what_is_missing(
        combine, monkeypatch):
    """apply_step's update threads hand the message each block of the new weights as they
    finish it, in any order: the combined checksum must be the one of the whole message; a
    block never handed over must fail the seal, not ship stale weights with a valid CRC (with
    zlib-ng's crc32_combine, and without it: an install that lacks zlib-ng)."""
    import random
    import threading

    import wire.messages
    from wire.messages import WeightsMessage

    if not combine:
        monkeypatch.setattr(wire.messages, "crc32_combine", None)

    params = np.random.default_rng(3).standard_normal(200_003).astype(np.float32)
    blocks = [slice(lo, min(lo + 4096, params.size)) for lo in range(0, params.size, 4096)]
    random.Random(3).shuffle(blocks)
    msg = WeightsMessage("job-x", 7, params.size, BUFFERS.size)
    threads = [threading.Thread(target=lambda part=blocks[k::3]: [msg.take_params(params, b)
                                                                  for b in part])
               for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    msg.buffers[:] = BUFFERS
    assert bytes(msg.seal()) == encode_weights("job-x", 7, params, BUFFERS)

    partial = WeightsMessage("job-x", 7, params.size, BUFFERS.size)
    for b in blocks:
        if b.start != 8192:
            partial.take_params(params, b)
    with pytest.raises(RuntimeError, match="params taken up to 8192 of 200003"):
        partial.seal()


def test_new_buffer_is_writable_bytes_of_the_size_asked():
    from wire.buffers import new_buffer

    buf = new_buffer(1 << 20)
    assert buf.format == "B" and buf.nbytes == 1 << 20 and not buf.readonly
    buf[:4] = b"abcd"
    assert bytes(buf[:4]) == b"abcd"


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_results_in_parts_are_the_message_without_copying_float32_arrays(dtype):
    """The parts an agent writes or sends one after the other join into exactly the message;
    a float32 gradient goes out as a view of the agent's own array (a phone does not hold the
    model-sized message twice)."""
    sent = _results()
    parts = encode_results_parts("job-1", 3, sent, dtype)
    assert b"".join(parts) == encode_results("job-1", 3, sent, dtype)
    grad_parts = [np.frombuffer(p, np.uint8) for p in parts[1::2]]
    shared = [np.shares_memory(g, r.grad_sum) for g, r in zip(grad_parts, sent)]
    assert shared == [dtype == "float32"] * len(sent)


def test_an_assignment_reads_back_what_the_server_sends_and_names_what_differs() -> None:
    from dataclasses import fields

    from api.schemas.work import WorkOut
    from wire.assignment import Assignment

    a = Assignment(job_id="job-1", step=3, shards=[0, 2], spec={"model": {"arch": "mlp"}},
                   n_params=10, n_buffers=0, n_stats=0, total_steps=9, n_train=100,
                   input_shape=[1, 8, 8], num_classes=10, bulk_url="http://h:8001")
    sent = WorkOut(assignment=a).model_dump(mode="json")["assignment"]  # what the API answers
    assert Assignment.from_json(sent) == a
    assert Assignment.from_json({k: v for k, v in sent.items() if k != "bulk_url"}).bulk_url is None
    schema = WorkOut.model_json_schema()
    defined = next(iter(schema["$defs"].values()))["properties"]
    assert set(defined) == {f.name for f in fields(Assignment)}  # one definition, both ends
    for broken, problem in ((dict(sent, step="3"), "'step' must be an integer"),
                            (dict(sent, shards=[0, True]), "'shards' must be a list of integers"),
                            ({k: v for k, v in sent.items() if k != "n_train"}, "lacks 'n_train'"),
                            ([], "must be a JSON object")):
        with pytest.raises(WireError, match=problem):
            Assignment.from_json(broken)


def test_a_sliced_jobs_weights_join_into_the_whole_message_and_bad_sets_are_refused():
    rng = np.random.default_rng(5)
    params, buffers = rng.standard_normal(100).astype(np.float32), np.ones(6, np.float32)
    bounds = [(0, 30), (30, 31), (31, 100)]
    parts = [encode_weights("j", 4, params[lo:hi], buffers if lo == 0 else buffers[:0],
                            part=(lo, hi)) for lo, hi in bounds]
    assert b"".join(join_weights("j", 4, parts)) == encode_weights("j", 4, params, buffers)
    with pytest.raises(WireError, match="does not follow"):
        join_weights("j", 4, [parts[0], parts[2]])  # a slice missing
    with pytest.raises(WireError, match="does not follow"):
        join_weights("j", 4, [parts[1], parts[0], parts[2]])  # out of order
    with pytest.raises(WireError, match="say which slice"):
        join_weights("j", 4, [encode_weights("j", 4, params, buffers)])
    with pytest.raises(WireError, match="step"):
        join_weights("j", 5, parts)  # another step's slices


def test_an_assignment_reads_slices_and_state_and_refuses_bad_ones():
    base = {"job_id": "j", "step": 1, "shards": [0], "spec": {}, "n_params": 3, "n_buffers": 0,
            "n_stats": 0, "total_steps": 2, "n_train": 8, "input_shape": [1, 2, 2],
            "num_classes": 2}
    old = Assignment.from_json(base)  # an older server: one weights message
    assert old.slices == [] and old.state is None
    a = Assignment.from_json({**base, "slices": [[0, 2], [2, 3]], "state": "ab12"})
    assert a.slices == [[0, 2], [2, 3]] and a.state == "ab12"
    with pytest.raises(WireError, match="slices"):
        Assignment.from_json({**base, "slices": [[0, "2"]]})


def _payload_offset(data: bytes | memoryview) -> int:
    return 15 + struct.unpack_from("<5sHII", data)[2]


def _unaligned(data: bytes) -> bytes:
    """The message as an older sender wrote it: a compact header, the payload where it falls
    (made unaligned here, whatever the header's length)."""
    hlen = struct.unpack_from("<5sHII", data)[2]
    raw = json.dumps(json.loads(data[15 : 15 + hlen]), separators=(",", ":")).encode()
    raw += b" " * (1 if (15 + len(raw)) % 4 == 0 else 0)
    payload = data[15 + hlen :]
    crc = zlib.crc32(payload, zlib.crc32(raw))
    return struct.pack("<5sHII", MAGIC, 1, len(raw), crc) + raw + payload


def test_every_message_puts_its_arrays_at_an_aligned_offset_and_unpadded_ones_still_decode():
    """numpy reads and writes a float32 view at an unaligned address through buffered copies
    (the server spent ~10% of its CPU on them): every message's payload starts at a multiple of
    64 bytes, so a message received into a fresh buffer decodes to aligned arrays. A message
    from an older sender (compact header, payload anywhere) decodes to the same values."""
    from wire.buffers import new_buffer
    from wire.messages import PAYLOAD_ALIGN, WeightsMessage

    sent = _results()
    messages = {"weights": encode_weights("job-1", 7, PARAMS, BUFFERS),
                **{dt: encode_results("job-1", 3, sent, dt)
                   for dt in ("float32", "float16", "bfloat16")}}
    filled = WeightsMessage("job-1", 7, PARAMS.size, BUFFERS.size)
    filled.params[:], filled.buffers[:] = PARAMS, BUFFERS
    assert filled.params.flags.aligned and filled.params.ctypes.data % 16 == 0
    messages["in place"] = bytes(filled.seal())
    for name, data in messages.items():
        assert _payload_offset(data) % PAYLOAD_ALIGN == 0, name
        received = new_buffer(len(data))  # as the server and the agent receive a body
        received[:] = data
        if name in ("weights", "in place"):
            arrays = decode_weights(received, "job-1", 7)[1:]
        else:
            arrays = [a for r in decode_results(received) for a in (r.grad_sum, r.stats)]
        if name != "bfloat16":  # bfloat16 is widened into new arrays
            assert all(a.flags.aligned for a in arrays), name
        old = _unaligned(data)
        assert _payload_offset(old) % 4 != 0
        if name in ("weights", "in place"):
            old_arrays = decode_weights(old, "job-1", 7)[1:]
        else:
            old_arrays = [a for r in decode_results(old) for a in (r.grad_sum, r.stats)]
        assert [a.tobytes() for a in old_arrays] == [a.tobytes() for a in arrays], name
    slices = [encode_weights("job-1", 7, PARAMS[lo:hi], BUFFERS if lo == 0 else BUFFERS[:0],
                             part=(lo, hi)) for lo, hi in ((0, 600), (600, 1000))]
    joined = b"".join(join_weights("job-1", 7, slices))
    assert _payload_offset(joined) % PAYLOAD_ALIGN == 0
    assert joined == messages["weights"]


def test_float64_arrays_go_out_as_float32_and_results_default_to_float32() -> None:
    wide = encode_weights("job-1", 3, PARAMS.astype(np.float64), BUFFERS.astype(np.float64))
    assert wide == encode_weights("job-1", 3, PARAMS, BUFFERS)
    sent = _results()
    assert b"".join(encode_results_parts("job-1", 3, sent)) == encode_results(
        "job-1", 3, sent, "float32")
