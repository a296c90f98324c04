"""Phone first (invariant 5): when the agent must not train, and when it may again.

Each rule pauses on one threshold and resumes on another, so a phone hovering at the limit
does not flap: thermal resumes `hysteresis_c` below `max_temp_c`, battery `hysteresis_pct` above
`min_battery` (or when plugged in), and a busy user only after `busy_quiet_s` without activity.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Limits:
    max_temp_c: float = 45.0
    min_battery: float = 20.0
    shared_mode: bool = False

    @classmethod
    def from_job_spec(cls, spec: dict[str, Any] | None, shared_default: bool = False) -> Limits:
        placement = (spec or {}).get("placement") or {}
        return cls(
            max_temp_c=float(placement.get("max_temp_c", cls.max_temp_c)),
            min_battery=float(placement.get("min_battery", cls.min_battery)),
            shared_mode=bool(placement.get("shared_mode", False)) or shared_default,
        )


@dataclass(frozen=True)
class Pause:
    reason: str  # thermal | battery | busy
    detail: str

    def to_json(self) -> dict[str, str]:
        return {"reason": self.reason, "detail": self.detail}


def temperature(reading: dict[str, Any]) -> tuple[str, float] | None:
    """The CPU temperature where readable, else the battery's (all an unrooted phone shows)."""
    for key, label in (("cpu_temp_c", "cpu"), ("battery_temp_c", "battery")):
        if reading.get(key) is not None:
            return label, float(reading[key])
    return None


class PhoneGuard:
    def __init__(self, hysteresis_c: float = 3.0, hysteresis_pct: float = 5.0,
                 busy_quiet_s: float = 30.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.hysteresis_c, self.hysteresis_pct = hysteresis_c, hysteresis_pct
        self.busy_quiet_s, self.clock = busy_quiet_s, clock
        self._active: dict[str, Pause] = {}
        self._last_busy: float | None = None

    def check(self, reading: dict[str, Any], limits: Limits) -> Pause | None:
        """Update the pause state from one reading; the pause that applies, or None."""
        self._thermal(reading, limits)
        self._battery(reading, limits)
        self._busy(reading, limits)
        for reason in ("thermal", "battery", "busy"):
            if reason in self._active:
                return self._active[reason]
        return None

    @property
    def paused(self) -> Pause | None:
        return next(iter(self._active.values()), None)

    def _thermal(self, reading: dict[str, Any], limits: Limits) -> None:
        temp = temperature(reading)
        if temp is None:
            return  # no sensor: keep whatever we last knew
        label, value = temp
        if value > limits.max_temp_c:
            detail = f"{label} {value:.1f} C > max_temp_c {limits.max_temp_c:g}"
            self._active["thermal"] = Pause("thermal", detail)
        elif value <= limits.max_temp_c - self.hysteresis_c:
            self._active.pop("thermal", None)

    def _battery(self, reading: dict[str, Any], limits: Limits) -> None:
        pct, charging = reading.get("battery_pct"), reading.get("charging")
        if pct is None:
            return
        if charging is not True and pct < limits.min_battery:
            detail = f"battery {pct:.0f}% < min_battery {limits.min_battery:g}% while discharging"
            self._active["battery"] = Pause("battery", detail)
        elif charging is True or pct >= limits.min_battery + self.hysteresis_pct:
            self._active.pop("battery", None)

    def _busy(self, reading: dict[str, Any], limits: Limits) -> None:
        now = self.clock()
        if reading.get("busy"):
            self._last_busy = now
        if not limits.shared_mode:
            self._active.pop("busy", None)
            return
        if self._last_busy is not None and now - self._last_busy < self.busy_quiet_s:
            why = "screen on" if reading.get("screen_on") else "other processes busy"
            if not reading.get("busy"):
                why = f"user active {now - self._last_busy:.0f}s ago"
            self._active["busy"] = Pause("busy", f"shared mode: {why}")
        else:
            self._active.pop("busy", None)
