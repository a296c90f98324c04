"""Is the phone's user busy? What an app sandbox can see of it.

- Screen: Termux:API has no screen-state command and `dumpsys` needs a permission Termux lacks,
  so the screen is read from the backlight (`/sys/class/backlight/*/brightness` > 0, `bl_power`
  0), which rooted phones, laptops and simulated phones expose; None where it is denied.
- Other processes busy: CPU time from `/proc/stat` (denied since Android 8, readable on Linux
  and rooted phones) minus the CPU time of the agent itself and its compute worker.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from agent.probes.sysfs import SysfsRoot

BACKLIGHT = "/sys/class/backlight"


def screen_on(fs: SysfsRoot) -> bool | None:
    seen = None
    for name in fs.listdir(BACKLIGHT):
        bright = fs.read_int(f"{BACKLIGHT}/{name}/brightness")
        if bright is None:
            continue
        power = fs.read_int(f"{BACKLIGHT}/{name}/bl_power")
        on = bright > 0 and (power is None or power == 0)
        seen = bool(seen) or on
    return seen


def _total_busy_s(fs: SysfsRoot) -> float | None:
    text = fs.read_text("/proc/stat")
    if not text or not text.startswith("cpu "):
        return None
    try:
        fields = [int(v) for v in text.splitlines()[0].split()[1:]]
    except ValueError:
        return None
    if len(fields) < 4:
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def own_cpu_s(pids: list[int]) -> float:
    """CPU seconds of this process (all threads) plus the given children, from the real /proc."""
    total = sum(os.times()[:2])
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, ValueError, IndexError):
            continue
    return total


class ForeignLoad:
    """Cores' worth of CPU used by others since the previous call (None when unreadable)."""

    def __init__(self, fs: SysfsRoot, own: Callable[[], float], clock: Callable[[], float] = time.monotonic):
        self.fs, self.own, self.clock = fs, own, clock
        self._last: tuple[float, float, float] | None = None

    def sample(self) -> float | None:
        total = _total_busy_s(self.fs)
        if total is None:
            return None
        now, mine = self.clock(), self.own()
        last, self._last = self._last, (now, total, mine)
        if last is None or now - last[0] <= 0:
            return None
        return max(0.0, ((total - last[1]) - (mine - last[2])) / (now - last[0]))


def read_busy(fs: SysfsRoot, load: ForeignLoad | None, load_limit: float) -> dict[str, Any]:
    out: dict[str, Any] = {}
    screen = screen_on(fs)
    if screen is not None:
        out["screen_on"] = screen
    foreign = load.sample() if load is not None else None
    if foreign is not None:
        out["foreign_load"] = round(foreign, 2)
    if screen is not None or foreign is not None:
        out["busy"] = bool(screen) or (foreign is not None and foreign > load_limit)
    return out
