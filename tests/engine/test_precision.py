"""Half the bytes, exactly: gradients rounded to bfloat16 or float16 where they are computed,
carried without further loss, and the rounding rule equal to torch's."""

from __future__ import annotations

import numpy as np
import pytest

from engine.precision import from_bfloat16_bits, round_to, to_bfloat16_bits
from engine.step import ShardResult
from tests.support.optional import require
from wire.messages import decode_results, encode_results


def _values() -> np.ndarray:
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(10_000) * 10.0 ** rng.integers(-8, 8, 10_000)).astype(np.float32)
    # ties: exactly half-way between two bfloat16 values, both parities
    ties = np.array([0x3F808000, 0x3F818000, 0xBF808000], dtype=np.uint32).view(np.float32)
    return np.concatenate([x, ties, np.float32([0.0, -0.0, 3.4e38, 1e-40])])


@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_the_rounding_is_torchs_round_to_nearest_even(precision):
    torch = require("torch")
    x = _values()
    ours = round_to(x, precision)
    kind = torch.bfloat16 if precision == "bfloat16" else torch.float16
    theirs = torch.from_numpy(x).to(kind).float().numpy()
    assert np.array_equal(ours, theirs, equal_nan=True)
    assert np.array_equal(round_to(ours, precision), ours)  # idempotent: already representable


def test_a_nan_stays_a_nan_in_bfloat16_and_the_wire_refuses_it():
    nans = np.array([0xFFFFFFFF, 0xFFFF8000, 0x7FFFFFFF, 0x7FC00000], np.uint32).view(np.float32)
    assert np.isnan(round_to(nans, "bfloat16")).all()
    bad = [ShardResult(0, np.concatenate([np.ones(3, np.float32), nans[:1]]), 0.0, 0, 1,
                       np.zeros(0, np.float32))]
    with pytest.raises(ValueError, match="not finite in bfloat16"):
        encode_results("j", 0, bad, dtype="bfloat16")


def test_bfloat16_bits_round_trip_what_was_rounded():
    x = round_to(_values(), "bfloat16")
    assert np.array_equal(from_bfloat16_bits(to_bfloat16_bits(x)), x)


@pytest.mark.parametrize("precision", ["bfloat16", "float16"])
def test_the_wire_carries_rounded_gradients_exactly_in_half_the_bytes(precision):
    rng = np.random.default_rng(1)
    grads = [round_to(rng.standard_normal(50_000).astype(np.float32), precision)
             for _ in range(3)]
    results = [ShardResult(k, g, 1.5, 3, 8, np.ones(4, np.float32))
               for k, g in enumerate(grads)]
    narrow = encode_results("job-x", 2, results, dtype=precision)
    wide = encode_results("job-x", 2, results)
    assert len(narrow) < 0.51 * len(wide)
    back = decode_results(narrow, expect_job="job-x", expect_step=2)
    for r, g in zip(back, grads):
        assert np.array_equal(r.grad_sum, g)


def test_float16_refuses_a_gradient_past_its_range_and_bfloat16_keeps_it():
    big = [ShardResult(0, np.float32([1e6, 1.0]), 0.0, 0, 1, np.zeros(0, np.float32))]
    with pytest.raises(ValueError, match="not finite in float16"):
        encode_results("j", 0, [ShardResult(0, round_to(big[0].grad_sum, "float16"), 0.0, 0, 1,
                                            big[0].stats)], dtype="float16")
    back = decode_results(encode_results("j", 0, big, dtype="bfloat16"))
    assert back[0].grad_sum[0] == round_to(np.float32([1e6]), "bfloat16")[0]
