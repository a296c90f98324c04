"""Battery: sysfs `power_supply`, Termux:API, psutil; one normalised answer.

Vendor quirks handled here, in one place:
- current may be µA (the ABI) or mA (several Samsung/MediaTek kernels): magnitudes below 8000
  are read as mA, since no phone draws 8 A and none runs a training step on 8 mA;
- its sign differs by vendor (the S10+ reports -812000 while *charging*), so the sign is taken
  from the charge status when that is known: positive means into the battery;
- voltage is µV in sysfs, mV from Termux:API; both become volts.
"""

from __future__ import annotations

from typing import Any

from agent.probes.sysfs import SysfsRoot

PS = "/sys/class/power_supply"
_MA_LIMIT = 8000.0


def current_amps(raw: float | None, status: str | None) -> float | None:
    """Raw vendor current (µA or mA, either sign) -> amps, positive while charging."""
    if raw is None:
        return None
    mag = abs(raw)
    amps = mag / 1000.0 if mag < _MA_LIMIT else mag / 1e6
    if status == "CHARGING":
        return amps
    if status == "DISCHARGING":
        return -amps
    return amps if raw >= 0 else -amps


def finish(reading: dict[str, Any]) -> dict[str, Any]:
    """Derive `current_a` and `power_w` from the raw fields a source provided."""
    raw = reading.pop("current_raw", None)
    amps = current_amps(raw, reading.get("status"))
    if amps is not None:
        reading["current_a"] = round(amps, 4)
        volts = reading.get("voltage_v")
        if volts and "power_w" not in reading:
            reading["power_w"] = round(volts * abs(amps), 3)
    return reading


def _battery_dir(fs: SysfsRoot) -> str | None:
    names = fs.listdir(PS)
    typed = [n for n in names if (fs.read_text(f"{PS}/{n}/type") or "").lower() == "battery"]
    for name in ["battery", *typed, *[n for n in names if n.upper().startswith("BAT")]]:
        if name in names and fs.read_int(f"{PS}/{name}/capacity") is not None:
            return f"{PS}/{name}"
    return None


def _external_power(fs: SysfsRoot) -> bool | None:
    seen = None
    for name in fs.listdir(PS):
        kind = (fs.read_text(f"{PS}/{name}/type") or name).lower()
        if kind == "battery" or name == "battery" or name.upper().startswith("BAT"):
            continue
        online = fs.read_int(f"{PS}/{name}/online")
        if online is not None:
            seen = bool(seen) or online == 1
    return seen


def read_sysfs_battery(fs: SysfsRoot) -> dict[str, Any] | None:
    base = _battery_dir(fs)
    if base is None:
        return None
    out: dict[str, Any] = {"source": "sysfs"}
    pct = fs.read_int(f"{base}/capacity")
    if pct is not None and 0 <= pct <= 100:
        out["battery_pct"] = float(pct)
    temp = fs.read_int(f"{base}/temp")  # tenths of a degree
    if temp is not None and -400 < temp < 1200:
        out["battery_temp_c"] = temp / 10.0
    volt = fs.read_int(f"{base}/voltage_now")
    if volt is not None and volt > 0:
        out["voltage_v"] = volt / 1e6 if volt > 100_000 else volt / 1000.0
    cur = fs.read_int(f"{base}/current_now")
    if cur is not None:
        out["current_raw"] = float(cur)
    power = fs.read_int(f"{base}/power_now")  # µW, laptops
    if power is not None and power >= 0:
        out["power_w"] = round(power / 1e6, 3)
    status = fs.read_text(f"{base}/status")
    if status:
        out["status"] = status.upper().replace(" ", "_")
    plugged = _external_power(fs)
    if plugged is not None:
        out["charging"] = plugged
    elif "status" in out:
        out["charging"] = out["status"] in ("CHARGING", "FULL")
    return out


def read_psutil_battery() -> dict[str, Any] | None:
    try:
        import psutil  # optional; Termux ships python-psutil
    except ImportError:
        return None
    try:
        bat = psutil.sensors_battery()
    except Exception:  # psutil raises assorted errors on odd kernels
        return None
    if bat is None:
        return None
    return {"source": "psutil", "battery_pct": float(bat.percent),
            "charging": bool(bat.power_plugged) if bat.power_plugged is not None else None}


def merge(primary: dict[str, Any] | None, *others: dict[str, Any] | None) -> dict[str, Any]:
    """First source wins per field; later ones only fill gaps."""
    out: dict[str, Any] = {}
    for src in (primary, *others):
        for key, value in (src or {}).items():
            if value is not None and key not in out:
                out[key] = value
    return out
