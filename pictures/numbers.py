"""Numbers rounded to what matters, for people (the API and `-o json` keep every digit): a loss
to 3 significant digits (0.025984847386877497 -> 0.0260), an accuracy as a percentage with two
decimals (0.9860724233983287 -> 98.61%), a rate or a time to 3 significant digits."""

from __future__ import annotations

import math
from typing import Any


def significant(value: float, digits: int = 3) -> str:
    """`value` to `digits` significant digits, trailing zeros kept (0.0260, 1.62, 12.3); past
    them a whole number with grouped thousands (1,234); under 0.0001 in powers of ten
    (2.60e-05)."""
    if not math.isfinite(value):
        return str(value)
    if value == 0:
        return "0"
    rounded = float(f"{value:.{digits - 1}e}")  # 99.96 -> 100: its decimals are 100's
    magnitude = math.floor(math.log10(abs(rounded)))
    if magnitude < -4:
        return f"{value:.{digits - 1}e}"
    if magnitude >= digits - 1:
        return f"{value:,.0f}"
    return f"{rounded:,.{max(0, digits - 1 - magnitude)}f}"


def percent(fraction: float, decimals: int = 2) -> str:
    """A fraction as a percentage: 0.9860724233983287 -> 98.61%."""
    return f"{fraction:.{decimals}%}" if math.isfinite(fraction) else str(fraction)


def metric(name: str, value: Any) -> Any:
    """A job metric as a person reads it: accuracies as percentages, losses and other floats to
    3 significant digits; integers, digests and the rest unchanged."""
    if isinstance(value, bool) or not isinstance(value, float):
        return value
    return percent(value) if "accuracy" in name else significant(value)
