"""Termux:API commands, run with a hard timeout.

`termux-battery-status` talks to the Termux:API app over a socket; when the app is missing or
asleep it hangs forever, so every call runs in its own process group that is killed on timeout
(killing only the shell would leave its child holding our pipe open).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from typing import Any

LONG_MIN = -(2**63)  # Android's Long.MIN_VALUE: "unknown" for BatteryManager counters


def run_json_command(argv: list[str], timeout_s: float) -> Any | None:
    """Run `argv`, parse its stdout as JSON; None when missing, failing, hanging or garbage."""
    exe = shutil.which(argv[0])
    if exe is None:
        return None
    try:
        proc = subprocess.Popen(
            [exe, *argv[1:]], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, start_new_session=True,
        )
    except OSError:
        return None
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        return None
    if proc.returncode != 0:
        return None
    try:
        return json.loads(out.decode("utf-8", errors="replace"))
    except ValueError:
        return None


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        proc.kill()
    try:
        proc.communicate(timeout=2)
    except subprocess.TimeoutExpired:
        pass


class TermuxBattery:
    """`termux-battery-status`, remembering a hang so one dead API does not stall every beat."""

    def __init__(self, timeout_s: float = 5.0, retry_after_s: float = 60.0) -> None:
        self.timeout_s = timeout_s
        self.retry_after_s = retry_after_s
        self._skip_until = 0.0

    def read(self) -> dict[str, Any] | None:
        now = time.monotonic()
        if now < self._skip_until:
            return None
        started = now
        data = run_json_command(["termux-battery-status"], self.timeout_s)
        if data is None and time.monotonic() - started >= self.timeout_s * 0.9:
            self._skip_until = time.monotonic() + self.retry_after_s
        return parse_battery_status(data) if isinstance(data, dict) else None


def _num(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if value == LONG_MIN or value != value:  # NaN
        return None
    return float(value)


def parse_battery_status(data: dict[str, Any]) -> dict[str, Any]:
    """Normalise both Termux:API shapes (see shared/android/) to our units.

    Current keeps the phone's own sign here; `agent.probes.battery.normalise_current` fixes sign
    and scale once it knows whether the battery charges.
    """
    out: dict[str, Any] = {"source": "termux"}
    pct = _num(data.get("percentage"))
    level, scale = _num(data.get("level")), _num(data.get("scale"))
    if pct is None and level is not None and scale:
        pct = 100.0 * level / scale
    if pct is not None and 0 <= pct <= 100:
        out["battery_pct"] = pct
    temp = _num(data.get("temperature"))
    if temp is not None and -40 < temp < 120:
        out["battery_temp_c"] = round(temp, 1)
    volt = _num(data.get("voltage"))  # mV
    if volt is not None and volt > 0:
        out["voltage_v"] = volt / 1000.0
    current = _num(data.get("current"))
    if current is not None:
        out["current_raw"] = current
    energy = _num(data.get("energy"))  # nWh, or Long.MIN_VALUE when unknown
    if energy is not None and energy >= 0:
        out["energy_wh"] = energy / 1e9
    status = data.get("status")
    plugged = data.get("plugged")
    if isinstance(status, str):
        out["status"] = status.upper()
    if isinstance(plugged, str):
        out["plugged"] = plugged.upper()
    charging = _charging(out.get("status"), out.get("plugged"))
    if charging is not None:
        out["charging"] = charging
    if isinstance(data.get("health"), str):
        out["health"] = data["health"].upper()
    return out


def _charging(status: str | None, plugged: str | None) -> bool | None:
    """On external power counts as charging: a full, plugged phone is not discharging."""
    if plugged is not None:
        return plugged != "UNPLUGGED"
    if status is not None:
        return status in ("CHARGING", "FULL")
    return None
