"""Temperatures: Android thermal zones, Linux hwmon, psutil; all in °C.

Zone units differ by kernel (millidegrees per the ABI, some vendors degrees or decidegrees), so
each value is scaled by magnitude and implausible results are dropped.
"""

from __future__ import annotations

from typing import Any

from agent.probes.sysfs import SysfsRoot, natural_key

THERMAL = "/sys/class/thermal"
HWMON = "/sys/class/hwmon"
_CPU_WORDS = ("cpu", "tsens", "cpuss", "apc", "x86_pkg", "coretemp", "k10temp", "soc", "big", "little")
_NOT_CPU = ("gpu", "skin", "batt", "xo", "pa", "modem", "wlan", "usb", "charger", "camera")


def to_celsius(raw: int | None) -> float | None:
    if raw is None:
        return None
    value = float(raw)
    if abs(value) >= 1000:
        value /= 1000.0
    elif abs(value) >= 200:
        value /= 10.0
    return round(value, 1) if -40.0 < value < 150.0 else None


def is_cpu_zone(kind: str) -> bool:
    k = kind.lower()
    return any(w in k for w in _CPU_WORDS) and not any(w in k for w in _NOT_CPU)


def read_zones(fs: SysfsRoot) -> dict[str, float]:
    """`{zone type: °C}` for every readable zone (duplicate types keep the hottest)."""
    zones: dict[str, float] = {}
    names = [n for n in fs.listdir(THERMAL) if n.startswith("thermal_zone")]
    for name in sorted(names, key=natural_key):
        temp = to_celsius(fs.read_int(f"{THERMAL}/{name}/temp"))
        if temp is None:
            continue
        kind = fs.read_text(f"{THERMAL}/{name}/type") or name
        zones[kind] = max(temp, zones.get(kind, temp))
    return zones


def read_hwmon(fs: SysfsRoot) -> dict[str, float]:
    out: dict[str, float] = {}
    for name in sorted(fs.listdir(HWMON), key=natural_key):
        chip = fs.read_text(f"{HWMON}/{name}/name") or name
        for entry in fs.listdir(f"{HWMON}/{name}"):
            if entry.startswith("temp") and entry.endswith("_input"):
                temp = to_celsius(fs.read_int(f"{HWMON}/{name}/{entry}"))
                if temp is not None:
                    key = f"{chip}/{entry[:-6]}"
                    out[key] = temp
    return out


def read_psutil_temps() -> dict[str, float]:
    try:
        import psutil
    except ImportError:
        return {}
    try:
        temps = psutil.sensors_temperatures()
    except Exception:  # not supported on this platform / kernel
        return {}
    out: dict[str, float] = {}
    for chip, entries in (temps or {}).items():
        for i, entry in enumerate(entries):
            if entry.current is not None and -40 < entry.current < 150:
                out[f"{chip}/{entry.label or i}"] = round(float(entry.current), 1)
    return out


def summarise(zones: dict[str, float]) -> dict[str, Any]:
    """cpu_temp_c: the hottest CPU-like sensor; skin_temp_c where a skin sensor exists."""
    out: dict[str, Any] = {}
    cpu = [t for k, t in zones.items() if is_cpu_zone(k)]
    if cpu:
        out["cpu_temp_c"] = max(cpu)
    skin = [t for k, t in zones.items() if "skin" in k.lower()]
    if skin:
        out["skin_temp_c"] = max(skin)
    return out
