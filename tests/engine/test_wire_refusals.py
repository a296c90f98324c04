"""Every refusal of the wire format, word for word (docs/contracts.md: decoding refuses "with a
WireError saying why"), and each check at its boundary: a message just inside passes. What a
phone's log or a 422 shows is this text, so it is pinned whole, not by a word in it.
With tests/engine/test_wire.py, what `scripts/mutation messages` judges wire/messages.py by."""

from __future__ import annotations

import json
import re
import struct
import zlib
from collections.abc import Callable

import numpy as np
import pytest

from engine.step import ShardResult
from wire.messages import (
    MAX_HEADER,
    NotFinite,
    WeightsMessage,
    WireError,
    decode_results,
    decode_weights,
    encode_results,
    encode_weights,
    join_results_parts,
    join_weights,
    results_payload,
    segment_bytes,
)

PREFIX = struct.Struct("<5sHII")
PARAMS = np.arange(10, dtype=np.float32)
BUFFERS = np.arange(3, dtype=np.float32)
WEIGHTS = encode_weights("job-1", 7, PARAMS, BUFFERS)


def result(shard: int = 4, n: int = 10, **kw) -> ShardResult:
    fields = {"loss_sum": 2.5, "correct": 3, "count": 8, "stats": np.ones(2, np.float32)}
    fields.update(kw)
    return ShardResult(shard, np.full(n, 0.5, np.float32), fields["loss_sum"], fields["correct"],
                       fields["count"], fields["stats"], fields.get("span", 1))


RESULTS = encode_results("job-1", 3, [result(4), result(1)])


def pack(header: dict | bytes, payload: bytes, *, magic: bytes = b"PHLXW", version: int = 1,
         hlen: int | None = None) -> bytes:
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    crc = zlib.crc32(payload, zlib.crc32(raw))
    return PREFIX.pack(magic, version, len(raw) if hlen is None else hlen, crc) + raw + payload


def split(data: bytes) -> tuple[dict, bytes]:
    hlen = PREFIX.unpack_from(data)[2]
    return json.loads(data[PREFIX.size:PREFIX.size + hlen]), data[PREFIX.size + hlen:]


def edited(data: bytes, edit: Callable[[dict], object], payload: bytes | None = None) -> bytes:
    header, body = split(data)
    edit(header)
    return pack(header, body if payload is None else payload)


def refused(call: Callable[[], object], message: str, error: type = WireError) -> None:
    with pytest.raises(error) as caught:
        call()
    assert str(caught.value) == message


W_HEADER, W_PAYLOAD = split(WEIGHTS)
R_HEADER, R_PAYLOAD = split(RESULTS)

WEIGHTS_REFUSALS = {
    "empty": (b"", {}, "truncated: 0 bytes is shorter than the header"),
    "one byte short of a prefix": (WEIGHTS[:14], {},
                                   "truncated: 14 bytes is shorter than the header"),
    "a prefix and nothing more": (WEIGHTS[:15], {},
                                  f"truncated: header of {PREFIX.unpack_from(WEIGHTS)[2]} bytes "
                                  "does not fit in 15 bytes"),
    "bad magic": (b"PHLXX" + WEIGHTS[5:], {}, "bad magic b'PHLXX': not a Phalanx wire message"),
    "version": (WEIGHTS[:5] + struct.pack("<H", 2) + WEIGHTS[7:], {},
                "unsupported wire version 2 (this side speaks 1)"),
    "header past the end": (pack(W_HEADER, b"", hlen=10_000), {},
                            f"truncated: header of 10000 bytes does not fit in "
                            f"{PREFIX.size + len(json.dumps(W_HEADER))} bytes"),
    "header over the cap": (pack(b" " * (MAX_HEADER + 1), b""), {},
                            f"truncated: header of {MAX_HEADER + 1} bytes does not fit in "
                            f"{PREFIX.size + MAX_HEADER + 1} bytes"),
    "checksum": (WEIGHTS[:-1] + bytes([WEIGHTS[-1] ^ 1]), {},
                 "checksum mismatch: the message was corrupted or truncated"),
    "not json": (pack(b"{nope", W_PAYLOAD), {}, None),
    "not an object": (pack(b"[1]", W_PAYLOAD), {}, "header must be a JSON object"),
    "nan": (pack(b'{"kind": NaN}', W_PAYLOAD), {}, "header is not valid JSON: header holds NaN: numbers must be finite"),
    "kind": (RESULTS, {}, "expected a weights message, got 'results'"),
    "job not a string": (edited(WEIGHTS, lambda h: h.update(job=1)), {},
                         "header needs a string job and an integer step"),
    "step a bool": (edited(WEIGHTS, lambda h: h.update(step=True)), {},
                    "header needs a string job and an integer step"),
    "job": (WEIGHTS, {"expect_job": "job-2"}, "message is for job 'job-1', expected 'job-2'"),
    "step": (WEIGHTS, {"expect_step": 8}, "message is for step 7, expected 8"),
    "n_params negative": (edited(WEIGHTS, lambda h: h.update(n_params=-1)), {},
                          "header field n_params must be a non-negative integer"),
    "n_buffers a bool": (edited(WEIGHTS, lambda h: h.update(n_buffers=False)), {},
                         "header field n_buffers must be a non-negative integer"),
    "n_params": (WEIGHTS, {"n_params": 9}, "n_params is 10, this model has 9"),
    "n_buffers": (WEIGHTS, {"n_buffers": 4}, "n_buffers is 3, this model has 4"),
    "dtype": (edited(WEIGHTS, lambda h: h.update(dtype="float16")), {},
              "weights dtype must be float32, got 'float16'"),
    "payload": (edited(WEIGHTS, lambda h: h.update(n_buffers=4)), {},
                "payload is 52 bytes, header says 56"),
    "nan weights": (encode_weights("job-1", 7, np.array([np.nan], np.float32), BUFFERS), {},
                    "weights holds NaN or infinity"),
}


@pytest.mark.parametrize("case", WEIGHTS_REFUSALS)
def test_a_weights_message_is_refused_saying_why(case: str) -> None:
    data, kwargs, message = WEIGHTS_REFUSALS[case]
    if message is None:  # the JSON parser's own words follow
        with pytest.raises(WireError, match=r"^header is not valid JSON: Expecting property"):
            decode_weights(data, **kwargs)
        return
    refused(lambda: decode_weights(data, **kwargs), message)


def test_weights_just_inside_every_check_decode() -> None:
    step, params, buffers = decode_weights(WEIGHTS, "job-1", 7, 10, 3)
    assert (step, params.tolist(), buffers.tolist()) == (7, PARAMS.tolist(), BUFFERS.tolist())
    assert params.flags.writeable and buffers.flags.writeable  # copies the caller owns
    empty = encode_weights("job-1", 0, np.zeros(0, np.float32), np.zeros(0, np.float32))
    assert [a.size for a in decode_weights(empty, n_params=0, n_buffers=0)[1:]] == [0, 0]
    at_cap = pack({**W_HEADER} | {"pad": " " * (MAX_HEADER - len(json.dumps(W_HEADER)) - 11)},
                  W_PAYLOAD)
    assert PREFIX.unpack_from(at_cap)[2] == MAX_HEADER
    assert decode_weights(at_cap)[0] == 7


def shard_edit(i: int = 0, **change) -> Callable[[dict], object]:
    return lambda h: h["shards"][i].update(change)


RESULTS_REFUSALS = {
    "kind": (WEIGHTS, {}, "expected a results message, got 'weights'"),
    "job": (RESULTS, {"expect_job": "job-2"}, "message is for job 'job-1', expected 'job-2'"),
    "n_params": (RESULTS, {"n_params": 9}, "n_params is 10, this model has 9"),
    "n_stats": (RESULTS, {"n_stats": 3}, "n_stats is 2, this model has 3"),
    "dtype": (edited(RESULTS, lambda h: h.update(dtype="int8")), {},
              "results dtype must be one of float32, float16, bfloat16, got 'int8'"),
    "precision": (RESULTS, {"expect_dtype": "bfloat16"},
                  "results in float32, but the job uploads in bfloat16 (upload_precision): an "
                  "agent too old for this job?"),
    "no shards": (edited(RESULTS, lambda h: h.update(shards=[])), {},
                  "results header needs a non-empty shards list"),
    "shards not a list": (edited(RESULTS, lambda h: h.update(shards={"0": 1})), {},
                          "results header needs a non-empty shards list"),
    "entry not an object": (edited(RESULTS, lambda h: h["shards"].__setitem__(0, 4)), {},
                            "each shard entry needs integer shard, correct and count"),
    "count a float": (edited(RESULTS, shard_edit(count=8.0)), {},
                      "each shard entry needs integer shard, correct and count"),
    "correct missing": (edited(RESULTS, lambda h: h["shards"][0].pop("correct")), {},
                        "each shard entry needs integer shard, correct and count"),
    "loss a bool": (edited(RESULTS, shard_edit(loss_sum=True)), {},
                    "shard 4: loss_sum must be a finite number"),
    "loss a string": (edited(RESULTS, shard_edit(loss_sum="1")), {},
                      "shard 4: loss_sum must be a finite number"),
    "loss too large": (edited(RESULTS, shard_edit(loss_sum=1e309)), {},
                       "header is not valid JSON: header holds Infinity: numbers must be "
                       "finite"),
    "span zero": (edited(RESULTS, shard_edit(span=0)), {},
                  "shard 4: span must be an integer >= 1"),
    "span a float": (edited(RESULTS, shard_edit(span=1.0)), {},
                     "shard 4: span must be an integer >= 1"),
    "negative shard": (edited(RESULTS, shard_edit(shard=-1)), {}, "shard -1 is negative"),
    "count zero": (edited(RESULTS, shard_edit(count=0, correct=0)), {},
                   "shard 4: count must be >= 1 and correct in 0..count"),
    "correct negative": (edited(RESULTS, shard_edit(correct=-1)), {},
                         "shard 4: count must be >= 1 and correct in 0..count"),
    "correct past count": (edited(RESULTS, shard_edit(correct=9)), {},
                           "shard 4: count must be >= 1 and correct in 0..count"),
    "twice": (edited(RESULTS, shard_edit(shard=1)), {},
              "shard 1 is listed twice (in the results from 1)"),
    "span overlaps": (edited(RESULTS, shard_edit(1, span=4)), {},
                      "shard 4 is listed twice (in the results from 1)"),
    "payload": (edited(RESULTS, lambda h: h["shards"].pop()), {},
                "payload is 96 bytes, header says 48"),
    "nan gradient": (edited(RESULTS, lambda h: None,
                            np.full(12, np.nan, np.float32).tobytes() + R_PAYLOAD[48:]), {},
                     "gradient holds NaN or infinity"),
}


@pytest.mark.parametrize("case", RESULTS_REFUSALS)
def test_a_results_message_is_refused_saying_why(case: str) -> None:
    data, kwargs, message = RESULTS_REFUSALS[case]
    refused(lambda: decode_results(data, **kwargs), message)


def test_results_just_inside_every_check_decode() -> None:
    adjacent = edited(RESULTS, shard_edit(1, span=3))  # shards 1..3 then 4: touching, no overlap
    got = decode_results(adjacent, "job-1", 3, 10, 2, "float32")
    assert [(r.shard, r.span) for r in got] == [(4, 1), (1, 3)]
    edge = edited(RESULTS, shard_edit(shard=0, correct=8, count=8, loss_sum=0))
    assert [(r.shard, r.correct, r.count) for r in decode_results(edge)][0] == (0, 8, 8)
    none_right = decode_results(edited(RESULTS, shard_edit(correct=0, count=1)))
    assert (none_right[0].correct, none_right[0].count) == (0, 1)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_narrow_results_round_trip_and_say_their_size(dtype: str) -> None:
    data = encode_results("job-1", 3, [result(4), result(1, span=2)], dtype)
    got = decode_results(data, expect_dtype=dtype)
    assert [(r.shard, r.span, r.grad_sum.tolist()) for r in got] == [
        (4, 1, [0.5] * 10), (1, 2, [0.5] * 10)]
    assert got[0].grad_sum.dtype == np.float32 and got[0].stats.tolist() == [1.0, 1.0]
    assert segment_bytes(dtype, 10, 2) == 2 * 10 + 4 * 2


def test_what_cannot_be_encoded_is_refused_saying_why() -> None:
    refused(lambda: encode_results("j", 0, []), "no results to encode")
    refused(lambda: encode_results("j", 0, [result()], "float64"),
            "dtype must be one of float32, float16, bfloat16, got 'float64'")
    refused(lambda: join_results_parts("j", 0, "int8", 1, 1, [], []),
            "dtype must be one of float32, float16, bfloat16, got 'int8'")
    refused(lambda: results_payload([result(4), result(5, n=11)]),
            "shard 5: arrays differ in size from shard 4's")
    refused(lambda: results_payload([result(4), result(5, stats=np.ones(3, np.float32))]),
            "shard 5: arrays differ in size from shard 4's")
    big = result(6)
    big.grad_sum[0] = 1e6
    refused(lambda: encode_results("j", 0, [big], "float16"),
            "shard 6: gradient is not finite in float16 (diverged, or too large for float16)",
            NotFinite)
    big.grad_sum[0] = np.inf
    refused(lambda: encode_results("j", 0, [big], "bfloat16"),
            "shard 6: gradient is not finite in bfloat16 (diverged, or too large for float16)",
            NotFinite)
    refused(lambda: encode_results("j", 0, [result(loss_sum=float("inf"))]),
            "header holds NaN or infinity (a shard's loss is not finite)", NotFinite)


def test_a_partial_says_its_span_and_a_single_shard_does_not() -> None:
    entries, _ = results_payload([result(4), result(8, span=4)])
    assert entries == [{"shard": 4, "loss_sum": 2.5, "correct": 3, "count": 8},
                       {"shard": 8, "loss_sum": 2.5, "correct": 3, "count": 8, "span": 4}]


def sliced(lo: int, hi: int, step: int = 4) -> bytes:
    return encode_weights("job-1", step, PARAMS[lo:hi], BUFFERS, part=(lo, hi))


def test_slices_join_only_as_one_cover_from_zero_saying_what_is_wrong() -> None:
    whole = b"".join(join_weights("job-1", 4, [sliced(0, 4), sliced(4, 10)]))
    assert whole == encode_weights("job-1", 4, PARAMS, BUFFERS)
    refused(lambda: join_weights("job-1", 4, []), "no slices")
    refused(lambda: join_weights("job-1", 4, [sliced(4, 10)]),
            "slice [4, 10) does not follow [.., 0)")
    refused(lambda: join_weights("job-1", 4, [sliced(0, 4), sliced(0, 4)]),
            "slice [0, 4) does not follow [.., 4)")
    empty = edited(sliced(0, 4), lambda h: h.update(slice=[0, 0], n_params=0),
                   BUFFERS.tobytes())
    refused(lambda: join_weights("job-1", 4, [empty]), "slice [0, 0) does not follow [.., 0)")
    for bad in ([0], [0, "4"], [0, True], "0-4"):
        refused(lambda bad=bad: join_weights("job-1", 4, [edited(sliced(0, 4), lambda h: h.update(
            slice=bad))]), "a slice's weights message must say which slice it is")
    refused(lambda: join_weights("job-1", 4, [edited(sliced(0, 4), lambda h: h.update(
        n_params=5))]), "n_params is 5, this model has 4")
    refused(lambda: join_weights("job-1", 4, [edited(sliced(0, 4), lambda h: h.update(
        n_buffers=2))]), "slice [0, 4): payload of the wrong size")
    refused(lambda: join_weights("job-1", 4, [edited(sliced(0, 4), lambda h: h.update(
        dtype="float16"))]), "weights dtype must be float32, got 'float16'")
    refused(lambda: join_weights("job-1", 5, [sliced(0, 10)]), "message is for step 4, expected 5")
    refused(lambda: join_weights("job-2", 4, [sliced(0, 10)]),
            "message is for job 'job-1', expected 'job-2'")


def test_a_weights_message_filled_out_of_order_blocks_names_the_gap() -> None:
    msg = WeightsMessage("job-1", 7, 10, 3)
    msg.buffers[:] = BUFFERS
    msg.take_params(PARAMS, slice(0, 4))
    msg.take_params(PARAMS, slice(6, 10))
    with pytest.raises(RuntimeError) as caught:
        msg.seal()
    assert re.fullmatch(r"weights message: params taken up to 4 of 10 \(blocks \[0, 6\]\.\.\.\)",
                        str(caught.value))
    msg.take_params(PARAMS, slice(4, 6))
    assert bytes(msg.seal()) == encode_weights("job-1", 7, PARAMS, BUFFERS)
