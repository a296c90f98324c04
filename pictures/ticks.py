"""Axis ticks people read: 1-2-5 steps (Heckbert's "nice numbers", Graphics Gems, 1990).

`nice_ticks(lo, hi)` widens [lo, hi] outwards to multiples of a nice step (1, 2 or 5 times a
power of ten) and lists the ticks between, each label with as many decimals as the step needs
and no more: a loss axis from 0.0109 to 3.22 reads 0, 1, 2, 3, 4; steps 0 to 99 read 0, 20,
40, 60, 80, 100. `zero=True` stretches the axis to 0 where 0 means something (a rate, a time,
an accuracy); temperatures in degrees Celsius do not ask for it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

_MAX_TICKS = 12


@dataclass(frozen=True)
class Axis:
    lo: float  # the axis' ends: the first and the last tick
    hi: float
    step: float
    exponent: int  # the step's power of ten
    values: tuple[float, ...]

    def label(self, value: float) -> str:
        """A tick's label: thousands grouped, `decimals` digits after the point, no -0; an
        axis of magnitudes under 0.001 or from 10 million on in powers of ten (2.5e-09)."""
        biggest = max(abs(self.lo), abs(self.hi))
        if biggest < 1e-3 or biggest >= 1e7:
            digits = max(0, math.floor(math.log10(biggest)) - self.exponent)
            return "0" if value == 0 else f"{value:.{digits}e}"
        shown = round(value, self.decimals)
        return f"{0.0 if shown == 0 else shown:,.{self.decimals}f}"

    @property
    def decimals(self) -> int:
        """What every label shows after the point."""
        return max(0, -self.exponent)

    def percent(self, value: float) -> str:
        """A tick of a 0..1 axis as a percentage (0.25 -> 25%)."""
        decimals = max(0, self.decimals - 2)
        shown = round(value * 100, decimals)
        return f"{0.0 if shown == 0 else shown:.{decimals}f}%"


def nice_number(x: float, rounded: bool) -> float:
    """1, 2, 5 or 10 times a power of ten near `x` (> 0): the nearest when `rounded`, else the
    smallest at least `x`."""
    exponent = math.floor(math.log10(x))
    fraction = x / 10.0**exponent
    if rounded:
        nice = 1 if fraction < 1.5 else 2 if fraction < 3 else 5 if fraction < 7 else 10
    else:
        nice = 1 if fraction <= 1 else 2 if fraction <= 2 else 5 if fraction <= 5 else 10
    return _scaled(nice, exponent)


def nice_ticks(lo: float, hi: float, target: int = 5, zero: bool = False,
               integer: bool = False) -> Axis:
    """About `target` nice ticks spanning [lo, hi] (given either way round); `zero`: the axis
    reaches 0; `integer`: no step below 1 (steps, counts). A single value gets an axis around
    it; values that are not finite are the caller's to drop."""
    lo, hi = (float(lo), float(hi)) if lo <= hi else (float(hi), float(lo))
    if not (math.isfinite(lo) and math.isfinite(hi)):
        raise ValueError(f"ticks need finite ends, got {lo!r} and {hi!r}")
    if zero:
        lo, hi = min(lo, 0.0), max(hi, 0.0)
    if hi - lo <= abs(hi) * 1e-12:  # one value (or equal to the last bits): an axis around it
        pad = abs(lo) * 0.05 if lo else 1.0
        lo, hi = (0.0, 1.0) if zero else (lo - pad, hi + pad)  # zero: lo == hi == 0 here
    step = nice_number(nice_number(hi - lo, False) / max(target - 1, 1), True)
    if integer:
        step = max(step, 1.0)
    exponent = math.floor(math.log10(step) + 1e-9)
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    while last - first > _MAX_TICKS:  # a target past _MAX_TICKS: fewer, wider steps
        step = nice_number(step * 1.5, True)
        exponent = math.floor(math.log10(step) + 1e-9)
        first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    mantissa = round(step / 10.0**exponent)
    values = tuple(_scaled(k * mantissa, exponent) for k in range(first, last + 1))
    return Axis(values[0], values[-1], step, exponent, values)


def _scaled(integer: int, exponent: int) -> float:
    """integer x 10**exponent as the nearest float (0.1 * 3 is 0.30000000000000004;
    3 / 10 is 0.3)."""
    return integer / 10.0**-exponent if exponent < 0 else float(integer * 10**exponent)
