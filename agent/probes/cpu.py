"""CPU frequencies per core and big.LITTLE clusters from cpufreq (usually readable unrooted)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from agent.probes.sysfs import SysfsRoot, natural_key, parse_cpu_list

CPU = "/sys/devices/system/cpu"


@dataclass(frozen=True)
class CoreFreq:
    core: int
    max_mhz: float | None
    cur_mhz: float | None
    cap_mhz: float | None  # scaling_max_freq: below max_mhz means a thermal/power cap


def core_ids(fs: SysfsRoot) -> list[int]:
    cores = parse_cpu_list(fs.read_text(f"{CPU}/possible"))
    if cores:
        return cores
    named = [n for n in fs.listdir(CPU) if n.startswith("cpu") and n[3:].isdigit()]
    return [int(n[3:]) for n in sorted(named, key=natural_key)]


def _mhz(fs: SysfsRoot, path: str) -> float | None:
    khz = fs.read_int(path)
    return round(khz / 1000.0, 1) if khz is not None and 0 < khz < 20_000_000 else None


def read_cores(fs: SysfsRoot) -> list[CoreFreq]:
    out = []
    for core in core_ids(fs):
        base = f"{CPU}/cpu{core}/cpufreq"
        out.append(CoreFreq(core, _mhz(fs, f"{base}/cpuinfo_max_freq"),
                            _mhz(fs, f"{base}/scaling_cur_freq"),
                            _mhz(fs, f"{base}/scaling_max_freq")))
    return out


def clusters(cores: list[CoreFreq]) -> list[dict[str, Any]]:
    """Cores with the same `cpuinfo_max_freq` form a cluster; slowest cluster first."""
    groups: dict[float, list[int]] = {}
    for c in cores:
        if c.max_mhz is not None:
            groups.setdefault(c.max_mhz, []).append(c.core)
    if not groups:
        n = os.cpu_count() or 1
        return [{"cores": list(range(n)), "max_mhz": None}]
    return [{"cores": sorted(v), "max_mhz": k} for k, v in sorted(groups.items())]


def summarise(cores: list[CoreFreq]) -> dict[str, Any]:
    cur = [c.cur_mhz for c in cores if c.cur_mhz is not None]
    out: dict[str, Any] = {}
    if cur:
        out["cpu_freq_mhz"] = round(sum(cur) / len(cur), 1)
        out["cpu_freqs_mhz"] = {str(c.core): c.cur_mhz for c in cores if c.cur_mhz is not None}
    capped = [c for c in cores if c.cap_mhz is not None and c.max_mhz is not None]
    if capped:
        out["throttled"] = any(c.cap_mhz < 0.95 * c.max_mhz for c in capped)  # type: ignore[operator]
    return out
