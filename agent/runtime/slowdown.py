"""PHALANX_AGENT_SLOWDOWN(_FILE): make a simulated phone slow on purpose (docs/contracts.md)."""

from __future__ import annotations

import os
import time


def factor() -> float:
    """The slowdown factor now: the file (re-read every call) wins over the variable; ≥ 1."""
    raw = None
    path = os.environ.get("PHALANX_AGENT_SLOWDOWN_FILE")
    if path:
        try:
            with open(path) as fh:
                raw = fh.read().strip()
        except OSError:
            raw = None
    if not raw:
        raw = os.environ.get("PHALANX_AGENT_SLOWDOWN")
    try:
        value = float(raw) if raw else 1.0
    except ValueError:
        return 1.0
    return value if value >= 1.0 and value == value else 1.0


def apply(compute_s: float) -> float:
    """Sleep `(factor - 1) × compute_s`; returns the seconds slept."""
    extra = (factor() - 1.0) * max(0.0, compute_s)
    if extra > 0:
        time.sleep(min(extra, 3600.0))
    return extra
