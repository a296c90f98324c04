"""Readings shared by the heartbeat and the work loop, and the guard's verdict on them."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from agent.runtime.guard import Limits, Pause, PhoneGuard


class Monitor:
    """Takes a reading at most every `max_age_s` unless asked for a fresh one: each runs
    termux-battery-status, ~0.5 s on a phone, which the work loop should not pay per chunk."""

    def __init__(self, read: Callable[[], dict[str, Any]], guard: PhoneGuard | None = None,
                 limits: Limits | None = None, max_age_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._read, self.guard = read, guard or PhoneGuard()
        self.limits = limits or Limits()
        self.max_age_s, self.clock = max_age_s, clock
        self._lock = threading.Lock()
        self._last: tuple[float, dict[str, Any]] | None = None
        self._pause: Pause | None = None
        self.throttle_events = 0  # counts False->True transitions of `throttled`
        self._was_throttled = False

    def set_limits(self, limits: Limits) -> None:
        with self._lock:
            self.limits = limits

    def reading(self, fresh: bool = False) -> dict[str, Any]:
        with self._lock:
            now = self.clock()
            if not fresh and self._last and now - self._last[0] < self.max_age_s:
                return self._last[1]
            reading = self._read()
            self._last = (now, reading)
            self._pause = self.guard.check(reading, self.limits)
            throttled = bool(reading.get("throttled"))
            if throttled and not self._was_throttled:
                self.throttle_events += 1
            self._was_throttled = throttled
            return reading

    def pause(self, fresh: bool = False) -> Pause | None:
        self.reading(fresh=fresh)
        with self._lock:
            return self._pause

    @property
    def last_pause(self) -> Pause | None:
        with self._lock:
            return self._pause

    def power_w(self) -> float | None:
        value = self.reading(fresh=True).get("power_w")
        return float(value) if value is not None else None
