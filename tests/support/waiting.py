"""Waiting for something a test cannot make happen at once: poll with a generous deadline, and
say what did not happen when it gives up. Never a timed assertion: the deadline only bounds
how long a broken build hangs."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

DEADLINE_S = 120.0


def wait_for(what: str, probe: Callable[[], Any], timeout: float = DEADLINE_S,
             every: float = 0.1, on_fail: Callable[[], str] | None = None) -> Any:
    """Poll `probe` until it returns something truthy, and return that; fail naming `what`."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(every)
    extra = on_fail() if on_fail else ""
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last={last!r}\n{extra}")
