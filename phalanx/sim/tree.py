"""Render a simulated phone as the files the real agent reads.

Layout as on a rooted Galaxy S10+ (`shared/android/sysfs-galaxy-s10plus-sm8150.txt`), below a
`PHALANX_SYSFS_ROOT`; `termux-battery-status` is a script on the phone's PATH that prints the
Termux:API JSON (`shared/android/termux-battery-status.json`) of the simulated state; the
speed factor goes to the file named by `PHALANX_AGENT_SLOWDOWN_FILE`. Every file is replaced
atomically, so an agent reading while the simulator writes sees the old or the new value.

`rooted=False` leaves out what SELinux denies an unrooted app (power_supply, thermal,
/proc/stat): the agent then sees battery and temperature through Termux:API only.
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path
from typing import Any

from phalanx.sim.model import PhoneModel

LONG_MIN = -(2**63)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def battery_status_json(model: PhoneModel) -> dict[str, Any]:
    """Exactly the key set of the current Termux:API `termux-battery-status`."""
    s = model.state
    current = model.battery_current_ua()
    pct = int(round(s.battery_pct))
    plugged = "PLUGGED_AC" if s.plugged else "UNPLUGGED"
    return {
        "present": True,
        "technology": "Li-ion",
        "health": model.battery_health(),
        "plugged": plugged,
        "status": model.battery_status(),
        "temperature": round(s.battery_c, 1),
        "voltage": model.battery_voltage_mv(),
        "current": current,
        "current_average": int(current * 0.97),
        "percentage": pct,
        "level": pct,
        "scale": 100,
        "charge_counter": int(model.profile.capacity_mah * 1000 * s.battery_pct / 100.0),
        "energy": LONG_MIN,
    }


def sysfs_files(model: PhoneModel, rooted: bool = True) -> dict[str, str]:
    """`{absolute kernel path: content}` for the phone's current state."""
    files: dict[str, str] = {}
    cpu = "/sys/devices/system/cpu"
    freqs = model.core_freqs_khz()
    files[f"{cpu}/possible"] = f"0-{len(freqs) - 1}"
    files[f"{cpu}/online"] = f"0-{len(freqs) - 1}"
    for core, (max_khz, cap_khz, cur_khz) in enumerate(freqs):
        base = f"{cpu}/cpu{core}/cpufreq"
        files[f"{base}/cpuinfo_max_freq"] = str(max_khz)
        files[f"{base}/scaling_max_freq"] = str(cap_khz)
        files[f"{base}/scaling_cur_freq"] = str(cur_khz)
    p = model.profile
    files["/proc/meminfo"] = (
        f"MemTotal:       {p.ram_kb:>9} kB\nMemFree:        {p.ram_kb // 8:>9} kB\n"
        f"MemAvailable:   {int(p.ram_kb * 0.4):>9} kB\n"
    )
    screen = "/sys/class/backlight/panel0-backlight"
    files[f"{screen}/brightness"] = "180" if model.state.faults.screen_on else "0"
    files[f"{screen}/bl_power"] = "0" if model.state.faults.screen_on else "4"
    if rooted:
        files.update(_power_supply(model))
        for i, (name, temp) in enumerate(model.zone_temps_c()):
            files[f"/sys/class/thermal/thermal_zone{i}/type"] = name
            files[f"/sys/class/thermal/thermal_zone{i}/temp"] = str(int(temp * 1000))
    return files


def getprop_values(model: PhoneModel) -> dict[str, str]:
    """The Android system properties the agent's hardware spec asks `getprop` for."""
    p = model.profile
    maker = "Google" if p.model.startswith("Nexus") else "samsung"
    return {"ro.product.model": p.model, "ro.product.manufacturer": maker,
            "ro.soc.model": p.soc, "ro.board.platform": p.soc.lower(),
            "ro.build.version.release": "12", "ro.build.version.sdk": "31"}


def getprop_script(model: PhoneModel) -> str:
    cases = "".join(f"  {shlex.quote(k)}) echo {shlex.quote(v)} ;;\n"
                    for k, v in getprop_values(model).items())
    return f'#!/bin/sh\ncase "$1" in\n{cases}  *) echo "" ;;\nesac\n'


def _power_supply(model: PhoneModel) -> dict[str, str]:
    s, ps = model.state, "/sys/class/power_supply"
    status = {"FULL": "Full", "CHARGING": "Charging", "DISCHARGING": "Discharging",
              "NOT_CHARGING": "Not charging"}[model.battery_status()]
    return {
        f"{ps}/battery/type": "Battery",
        f"{ps}/battery/capacity": str(int(round(s.battery_pct))),
        f"{ps}/battery/status": status,
        f"{ps}/battery/health": "Overheat" if model.battery_health() == "OVERHEAT" else "Good",
        f"{ps}/battery/temp": str(int(round(s.battery_c * 10))),
        f"{ps}/battery/voltage_now": str(model.battery_voltage_mv() * 1000),
        f"{ps}/battery/current_now": str(model.profile.sysfs_current_sign
                                         * model.battery_current_ua()),
        f"{ps}/usb/type": "USB",
        f"{ps}/usb/online": "1" if s.plugged else "0",
    }


class PhoneFiles:
    """One phone's directory: `root/` (PHALANX_SYSFS_ROOT), `bin/` (PATH), state files."""

    def __init__(self, home: Path, rooted: bool = True) -> None:
        self.home = Path(home)
        self.rooted = rooted
        self.root = self.home / "root"
        self.bin = self.home / "bin"
        self.battery_json = self.home / "termux-battery-status.json"
        self.slowdown_file = self.home / "slowdown"
        self._written: dict[str, str] = {}

    def install(self, model: PhoneModel) -> None:
        """Create the tree, the `termux-battery-status` and `getprop` scripts, write the state."""
        self.bin.mkdir(parents=True, exist_ok=True)
        script = self.bin / "termux-battery-status"
        _write(script, f"#!/bin/sh\nexec cat {shlex.quote(str(self.battery_json))}\n")
        script.chmod(0o755)
        getprop = self.bin / "getprop"
        _write(getprop, getprop_script(model))
        getprop.chmod(0o755)
        self.write(model)

    def write(self, model: PhoneModel) -> None:
        """Render the model's state; only files whose content changed are rewritten."""
        files = sysfs_files(model, self.rooted)
        for path, text in files.items():
            if self._written.get(path) != text:
                _write(self.root / path.lstrip("/"), text + "\n")
                self._written[path] = text
        _write(self.battery_json, json.dumps(battery_status_json(model), indent=2) + "\n")
        _write(self.slowdown_file, f"{model.slowdown:.3f}\n")

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """The environment an agent process of this phone runs with."""
        env = dict(os.environ if base is None else base)
        env["PHALANX_SYSFS_ROOT"] = str(self.root)
        env["PHALANX_AGENT_SLOWDOWN_FILE"] = str(self.slowdown_file)
        env["PATH"] = f"{self.bin}{os.pathsep}{env.get('PATH', '')}"
        return env
