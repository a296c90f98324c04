"""Probes against fixture phones built from shared/android/: rooted, unrooted, missing, garbage."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import psutil
import pytest

from agent.hardware import collect_spec
from agent.probes import Probes, to_sample
from agent.probes.battery import current_amps
from agent.probes.sysfs import SysfsRoot, parse_cpu_list
from agent.probes.termux import TermuxBattery
from agent.probes.thermal import to_celsius
from tests.agent import phone
from tests.support.waiting import wait_for


def test_a_rooted_galaxy_s10_reads_in_normalised_units(rooted: Path) -> None:
    r = Probes(str(rooted), use_psutil=False).read()
    assert r["battery_pct"] == 87
    assert r["charging"] is True
    assert r["battery_temp_c"] == 36.2
    assert r["voltage_v"] == pytest.approx(4.215)
    # the S10+ reports -812000 uA while charging: into the battery is positive
    assert r["current_a"] == pytest.approx(0.812)
    assert r["power_w"] == pytest.approx(4.215 * 0.812, abs=1e-3)
    assert r["cpu_temp_c"] == 51.8  # hottest cpu zone, not the gpu or skin
    assert r["skin_temp_c"] == 38.9
    freqs = [1171.2] * 4 + [2419.2, 1996.8, 1996.8, 2841.6]
    assert r["cpu_freq_mhz"] == pytest.approx(sum(freqs) / 8, abs=0.1)
    assert r["ram_mb"] == 7619500 // 1024
    assert r["mem_available_mb"] == 3011212 // 1024


def test_the_heartbeat_sample_carries_the_contract_keys_only(rooted: Path) -> None:
    sample = to_sample(Probes(str(rooted), use_psutil=False).read())
    assert set(sample) == {"ts", "battery_pct", "charging", "battery_temp_c", "cpu_temp_c",
                           "power_w", "cpu_freq_mhz"}
    json.dumps(sample)  # the wire is JSON


def test_clusters_group_cores_by_max_frequency(rooted: Path) -> None:
    spec = collect_spec(SysfsRoot(rooted))
    assert [c["cores"] for c in spec["clusters"]] == [[0, 1, 2, 3], [4, 5, 6], [7]]
    assert [c["max_mhz"] for c in spec["clusters"]] == [1785.6, 2419.2, 2841.6]
    assert spec["cpu_cores"] == 8
    assert spec["ram_mb"] == 7440
    assert "numpy" in spec["backends"] and spec["numpy"]


def test_an_unrooted_phone_reads_battery_from_termux_and_skips_denied_paths(
    unrooted: Path, termux
) -> None:
    termux(phone.termux_payload())
    r = Probes(str(unrooted), use_psutil=False).read()
    assert r["battery_sources"] == ["termux"]
    assert r["battery_pct"] == 87 and r["charging"] is True
    assert r["battery_temp_c"] == 36.2
    assert r["current_a"] == pytest.approx(0.812)  # 812000 uA, charging
    assert r["power_w"] == pytest.approx(3.423, abs=1e-3)
    assert "energy_wh" not in r  # Long.MIN_VALUE means unknown
    assert "cpu_temp_c" not in r and "zones" not in r
    assert r["cpu_freq_mhz"] > 0 and r["ram_mb"] == 7440  # cpufreq and meminfo still read


def test_the_old_termux_shape_reads_too(unrooted: Path, termux) -> None:
    termux(phone.termux_payload(old=True))
    r = Probes(str(unrooted), use_psutil=False).read()
    assert r["battery_pct"] == 41 and r["charging"] is False
    assert r["battery_temp_c"] == 46.8
    assert r["current_a"] == pytest.approx(-1.312)  # mA on old builds, discharging
    assert "power_w" not in r  # no voltage in this shape: no made-up power


def test_a_hanging_termux_api_costs_one_timeout_then_is_skipped(unrooted: Path, termux) -> None:
    script = termux(hang=True)
    calls = script.parent / "calls"
    probes = Probes(str(unrooted), use_psutil=False, termux_timeout_s=0.5)
    r = probes.read()
    assert "battery_pct" not in r
    # the command and its child (which sleeps 600 s) were killed, not waited for
    pids = [int(line) for line in calls.read_text().split()]
    assert len(pids) == 2

    def gone(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    # SIGKILL was sent to the group; the kernel takes a moment to end them on a busy machine
    wait_for("the hung command and its child to die", lambda: all(gone(p) for p in pids),
             timeout=30)
    probes.read()
    assert calls.read_text().split() == [str(p) for p in pids]  # remembered as hung: not run again


@pytest.mark.parametrize("payload", ["not json {", "[1, 2]", "", json.dumps({"percentage": "x"})])
def test_garbage_from_termux_is_ignored(unrooted: Path, termux, payload: str) -> None:
    termux(payload)
    r = Probes(str(unrooted), use_psutil=False).read()
    assert "battery_pct" not in r and r["ram_mb"] == 7440


def test_a_failing_termux_command_is_ignored(unrooted: Path, termux) -> None:
    termux(phone.termux_payload(), exit_code=1)
    assert TermuxBattery().read() is None


def test_a_missing_tree_reads_as_nothing_without_error(tmp_path: Path) -> None:
    r = Probes(str(tmp_path / "nothing-here"), use_psutil=False).read()
    assert set(r) == {"ts"}
    spec = collect_spec(SysfsRoot(tmp_path / "nothing-here"))
    assert spec["cpu_cores"] >= 1 and spec["clusters"]


def test_garbage_values_are_dropped_not_guessed(tmp_path: Path) -> None:
    root = phone.build_tree(tmp_path / "junk", "garbage")
    r = Probes(str(root), use_psutil=False).read()
    assert set(r) <= {"ts", "battery_sources", "status", "charging"}
    spec = collect_spec(SysfsRoot(root))
    assert spec["cpu_cores"] >= 1


def test_implausible_numbers_are_dropped(rooted: Path) -> None:
    phone.set_value(rooted, "/sys/class/power_supply/battery/capacity", 250)
    phone.set_value(rooted, "/sys/class/thermal/thermal_zone1/temp", 9_999_999)
    r = Probes(str(rooted), use_psutil=False).read()
    assert "battery_pct" not in r
    assert r["cpu_temp_c"] == 47.3  # the other cpu zone


REPO = Path(__file__).resolve().parents[2]


def agent_only_copy(dest: Path) -> Path:
    """The `agent` package alone (no engine, no wire), world-readable, in `dest`."""
    shutil.copytree(REPO / "agent", dest / "agent", ignore=shutil.ignore_patterns("__pycache__"))
    for path in [dest, *dest.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return dest


def read_probes_code(root: Path) -> str:
    return ("import json, sys; from agent.probes import Probes; "
            f"r = Probes({str(root)!r}, use_psutil=False).read(); "
            "r['loaded'] = sorted({m.split('.')[0] for m in sys.modules} & "
            "{'numpy', 'engine', 'wire', 'psutil'}); print(json.dumps(r))")


def test_the_probes_need_only_the_standard_library(tmp_path: Path) -> None:
    """In a venv made `--without-pip` there is nothing but the standard library: the probes
    read a phone there, and load neither numpy nor anything of ours beyond `agent`."""
    venv = tmp_path / "stdlib-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = str(venv / "bin" / "python")
    src = agent_only_copy(tmp_path / "src")
    env = {"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"}
    no_numpy = subprocess.run([python, "-c", "import numpy"], env=env, capture_output=True,
                              text=True, timeout=60)
    assert no_numpy.returncode != 0 and "No module named 'numpy'" in no_numpy.stderr
    root = phone.build_tree(tmp_path / "phone")
    out = subprocess.run([python, "-c", read_probes_code(root)], env=env, cwd="/",
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["battery_pct"] == 87 and r["cpu_temp_c"] == 51.8
    assert r["loaded"] == []


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to drop to an unprivileged user")
def test_real_permission_denied_as_an_unprivileged_user() -> None:
    """SELinux-style denials, for real: `nobody` reads a tree whose power_supply and thermal
    folders it may not enter. The probes need only the standard library, so the system's
    python3 (which `nobody` may run) will do."""
    nobody = pwd.getpwnam("nobody")  # KeyError: the machine lacks the user this test needs
    python = shutil.which("python3", path="/usr/bin:/bin")
    assert python is not None, "no /usr/bin/python3 for `nobody` to run (apt-get install python3)"
    with tempfile.TemporaryDirectory(dir="/tmp") as tmp:
        os.chmod(tmp, 0o755)  # pytest's own tmp_path is root-only
        src = agent_only_copy(Path(tmp) / "src")
        root = phone.build_tree(Path(tmp) / "phone")
        for sub in ("sys/class/power_supply", "sys/class/thermal"):
            (root / sub).chmod(0o000)
        out = subprocess.run([python, "-c", read_probes_code(root)], user=nobody.pw_uid, cwd="/",
                             env={"PYTHONPATH": str(src), "PATH": "/usr/bin:/bin"},
                             capture_output=True, text=True, timeout=60)
        for sub in ("sys/class/power_supply", "sys/class/thermal"):
            (root / sub).chmod(0o755)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert "battery_pct" not in r and "cpu_temp_c" not in r
    assert r["cpu_freq_mhz"] > 0 and r["ram_mb"] == 7440


@pytest.mark.parametrize(
    ("raw", "status", "amps"),
    [
        (-812000, "CHARGING", 0.812),  # Samsung: negative uA while charging
        (812000, "CHARGING", 0.812),  # Termux:API / ABI: positive while charging
        (1312000, "DISCHARGING", -1.312),  # positive uA while discharging (some vendors)
        (-1312, "DISCHARGING", -1.312),  # mA
        (450, "FULL", 0.45),  # unknown direction: keep the sign given
        (-450, "NOT_CHARGING", -0.45),
    ],
)
def test_current_sign_and_scale_quirks(raw: int, status: str, amps: float) -> None:
    assert current_amps(raw, status) == pytest.approx(amps)


@pytest.mark.parametrize(("raw", "celsius"), [(47300, 47.3), (473, 47.3), (47, 47.0),
                                               (-5000, -5.0), (9_999_999, None), (None, None)])
def test_thermal_units_by_magnitude(raw: int | None, celsius: float | None) -> None:
    assert to_celsius(raw) == celsius


@pytest.mark.parametrize(("text", "cpus"), [("0-7", list(range(8))), ("0-3,6,8-9", [0, 1, 2, 3, 6, 8, 9]),
                                            ("0", [0]), ("junk", []), ("7-3", []), (None, [])])
def test_cpu_lists(text: str | None, cpus: list[int]) -> None:
    assert parse_cpu_list(text) == cpus


def test_the_probe_command_prints_json_for_a_fixture_phone(rooted: Path) -> None:
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PHALANX_SYSFS_ROOT=str(rooted))
    out = subprocess.run([sys.executable, "-m", "agent", "probe"], cwd=repo, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["reading"]["battery_pct"] == 87
    assert data["spec"]["cpu_cores"] == 8


def test_a_linux_laptop_reads_hwmon_and_a_bat0_battery(tmp_path: Path) -> None:
    root = tmp_path / "laptop"
    for path, value in {
        "/sys/class/hwmon/hwmon0/name": "coretemp",
        "/sys/class/hwmon/hwmon0/temp1_input": "55000",
        "/sys/class/hwmon/hwmon0/temp2_input": "61000",
        "/sys/class/hwmon/hwmon1/name": "nvme",
        "/sys/class/hwmon/hwmon1/temp1_input": "40000",
        "/sys/class/power_supply/BAT0/type": "Battery",
        "/sys/class/power_supply/BAT0/capacity": "64",
        "/sys/class/power_supply/BAT0/status": "Discharging",
        "/sys/class/power_supply/BAT0/power_now": "9500000",
        "/sys/class/power_supply/AC/type": "Mains",
        "/sys/class/power_supply/AC/online": "0",
        "/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq": "4000000",
        "/sys/devices/system/cpu/cpu0/cpufreq/scaling_max_freq": "2000000",
        "/sys/devices/system/cpu/cpu0/cpufreq/scaling_cur_freq": "1900000",
    }.items():
        phone.write(root, path, value)
    r = Probes(str(root), use_psutil=False).read()
    assert r["cpu_temp_c"] == 61.0  # coretemp, not the disk
    assert r["battery_pct"] == 64 and r["charging"] is False
    assert r["power_w"] == 9.5
    assert r["throttled"] is True  # capped at half its maximum frequency
    assert r["cpu_freq_mhz"] == 1900.0
