"""Telemetry probes: one `Probes.read()` gives everything the phone lets us see, normalised.

Sources by preference: Termux:API (the only reliable one on an unrooted phone), sysfs
(`PHALANX_SYSFS_ROOT`), then psutil when reading the real machine (laptops, servers).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from agent.probes import battery, busy, cpu, memory, thermal
from agent.probes.sysfs import SysfsRoot
from agent.probes.termux import TermuxBattery

SAMPLE_KEYS = ("battery_pct", "charging", "battery_temp_c", "cpu_temp_c", "power_w",
               "cpu_freq_mhz", "throttled", "busy")


class Probes:
    def __init__(
        self,
        root: str | None = None,
        *,
        termux_timeout_s: float = 5.0,
        use_psutil: bool | None = None,
        own_cpu: Callable[[], float] | None = None,
        busy_load_limit: float = 0.5,
    ) -> None:
        self.fs = SysfsRoot(root)
        self.termux = TermuxBattery(timeout_s=termux_timeout_s)
        self.use_psutil = self.fs.is_real if use_psutil is None else use_psutil
        self.load = busy.ForeignLoad(self.fs, own_cpu or (lambda: busy.own_cpu_s([])))
        self.busy_load_limit = busy_load_limit

    def read(self) -> dict[str, Any]:
        """A full reading: the telemetry sample keys plus details (sources, volts, zones...)."""
        reading: dict[str, Any] = {"ts": time.time()}
        reading.update(self._battery())
        zones = thermal.read_zones(self.fs)
        zones.update({f"hwmon:{k}": v for k, v in thermal.read_hwmon(self.fs).items()})
        if not zones and self.use_psutil:
            zones = {f"psutil:{k}": v for k, v in thermal.read_psutil_temps().items()}
        reading.update(thermal.summarise(zones))
        if zones:
            reading["zones"] = zones
        reading.update(cpu.summarise(cpu.read_cores(self.fs)))
        reading.update(memory.read_memory(self.fs))
        reading.update(busy.read_busy(self.fs, self.load, self.busy_load_limit))
        return reading

    def _battery(self) -> dict[str, Any]:
        termux = self.termux.read()
        sysfs = battery.read_sysfs_battery(self.fs)
        ps = battery.read_psutil_battery() if self.use_psutil else None
        parts = [battery.finish(p) for p in (termux, sysfs, ps) if p]
        merged = battery.merge(*parts) if parts else {}
        if parts:
            merged["battery_sources"] = [p["source"] for p in parts]
            merged.pop("source", None)
        return merged


def to_sample(reading: dict[str, Any]) -> dict[str, Any]:
    """The heartbeat telemetry sample: `ts` and the contract's keys that have a value."""
    sample: dict[str, Any] = {"ts": reading["ts"]}
    sample.update({k: reading[k] for k in SAMPLE_KEYS if reading.get(k) is not None})
    return sample
