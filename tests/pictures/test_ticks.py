"""Nice ticks (pictures.ticks): 1-2-5 steps that frame the data, at the edges of what a chart
is handed: one value, a range of a few ulps, negatives, zero asked for or not."""

from __future__ import annotations

import math

import pytest

from pictures.ticks import nice_number, nice_ticks


def is_nice(step: float) -> bool:
    mantissa = step / 10.0 ** math.floor(math.log10(step) + 1e-9)
    return any(math.isclose(mantissa, m) for m in (1, 2, 5, 10))


@pytest.mark.parametrize(("lo", "hi", "kw", "labels"), [
    # the loss axis (0.0109, 0.814, 1.62, ...) and step axis (0, 25, 50, 74, 99)
    (0.0109, 3.22, {"zero": True}, ["0", "1", "2", "3", "4"]),
    (0, 99, {"zero": True, "integer": True}, ["0", "20", "40", "60", "80", "100"]),
    (0.91, 0.99, {}, ["0.90", "0.92", "0.94", "0.96", "0.98", "1.00"]),
    (-3.2, -0.4, {}, ["-4", "-3", "-2", "-1", "0"]),
    (-5, 12, {}, ["-5", "0", "5", "10", "15"]),
    (12_345, 98_765, {"zero": True}, ["0", "20,000", "40,000", "60,000", "80,000", "100,000"]),
    (1e-9, 3e-9, {}, ["1.0e-09", "1.5e-09", "2.0e-09", "2.5e-09", "3.0e-09"]),
    (3e7, 9e7, {}, ["2.0e+07", "4.0e+07", "6.0e+07", "8.0e+07", "1.0e+08"]),
], ids=["loss-from-zero", "steps", "accuracy-close-up", "negative", "across-zero",
        "thousands", "tiny-magnitudes", "huge-magnitudes"])
def test_ticks_are_1_2_5_steps_that_frame_the_data(lo, hi, kw, labels) -> None:
    axis = nice_ticks(lo, hi, **kw)
    assert [axis.label(v) for v in axis.values] == labels
    assert axis.lo <= min(lo, hi) and axis.hi >= max(lo, hi) and is_nice(axis.step)


@pytest.mark.parametrize(("value", "kw", "labels"), [
    (36.0, {}, ["34", "35", "36", "37", "38"]),  # a constant temperature: around it
    (0.0, {}, ["-1.0", "-0.5", "0.0", "0.5", "1.0"]),
    (0.0, {"zero": True}, ["0.0", "0.2", "0.4", "0.6", "0.8", "1.0"]),
    (0.2, {"zero": True}, ["0.00", "0.05", "0.10", "0.15", "0.20"]),  # a single point
    (-7.0, {"zero": True}, ["-8", "-6", "-4", "-2", "0"]),
    (5.0, {"integer": True}, ["4", "5", "6"]),  # one step: never half steps
])
def test_one_value_gets_an_axis_around_it_or_from_zero(value, kw, labels) -> None:
    axis = nice_ticks(value, value, **kw)
    assert [axis.label(v) for v in axis.values] == labels


def test_a_range_of_a_few_parts_in_ten_million_still_reads_apart() -> None:
    axis = nice_ticks(1.0000001, 1.0000002)
    labels = [axis.label(v) for v in axis.values]
    assert labels[0] == "1.00000010" and labels[-1] == "1.00000020"
    assert len(set(labels)) == len(labels) == 6


def test_values_are_the_exact_decimals_not_float_noise() -> None:
    axis = nice_ticks(0, 1, target=11)
    assert axis.values == (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
    assert nice_ticks(-0.3, 0.3).label(0.0) == "0.0"  # never "-0.0"


def test_ends_given_backwards_or_infinite() -> None:
    assert nice_ticks(99, 0, zero=True, integer=True).values == nice_ticks(0, 99, zero=True,
                                                                           integer=True).values
    with pytest.raises(ValueError, match="finite"):
        nice_ticks(0, math.inf)


def test_never_more_than_a_dozen_ticks_and_percent_labels() -> None:
    assert len(nice_ticks(0, 1000, target=500).values) <= 13
    axis = nice_ticks(0.91, 0.99, zero=True)
    assert [axis.percent(v) for v in axis.values] == ["0%", "20%", "40%", "60%", "80%", "100%"]


@pytest.mark.parametrize(("x", "rounded", "nice"), [
    (0.73, False, 1.0), (0.73, True, 1.0), (0.65, True, 0.5), (1.4, True, 1.0), (2.9, True, 2.0), (3.0, True, 5.0),
    (7.0, True, 10.0), (2.0, False, 2.0), (2.01, False, 5.0), (4200, True, 5000.0),
])
def test_nice_numbers(x, rounded, nice) -> None:
    assert nice_number(x, rounded) == nice
