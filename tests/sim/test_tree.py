"""The rendered phone, as the real agent's probes read it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from agent.probes import Probes
from phalanx.sim.model import PhoneModel
from phalanx.sim.profiles import get_profile
from phalanx.sim.tree import PhoneFiles, sysfs_files

SHARED = Path(__file__).resolve().parents[1] / "fixtures" / "android"  # shared/android/


def sample_paths() -> set[str]:
    text = (SHARED / "sysfs-galaxy-s10plus-sm8150.txt").read_text()
    return {line.split("\t")[0] for line in text.splitlines() if line and not line.startswith("#")}


@pytest.fixture
def phone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[PhoneModel, PhoneFiles]:
    model = PhoneModel(get_profile("galaxy-s10plus-sd855"), battery_pct=87, time_scale=10)
    files = PhoneFiles(tmp_path / "phone")
    files.install(model)
    monkeypatch.setenv("PATH", files.env()["PATH"])
    return model, files


def test_a_rooted_s10_has_every_path_of_the_real_phones_sample() -> None:
    model = PhoneModel(get_profile("galaxy-s10plus-sd855"))
    assert sample_paths() <= set(sysfs_files(model, rooted=True))


def test_termux_script_prints_the_exact_termux_api_shape(phone: tuple[PhoneModel, PhoneFiles]) -> None:
    _, files = phone
    out = subprocess.run(["termux-battery-status"], capture_output=True, text=True, check=True,
                         env=files.env())
    printed = json.loads(out.stdout)
    real = json.loads((SHARED / "termux-battery-status.json").read_text())
    assert list(printed) == list(real)
    assert {k: type(v) for k, v in printed.items()} == {k: type(v) for k, v in real.items()}


def test_the_agent_probes_read_the_simulated_state(phone: tuple[PhoneModel, PhoneFiles]) -> None:
    model, files = phone
    reading = Probes(str(files.root), use_psutil=False).read()
    assert reading["battery_pct"] == 87
    assert reading["charging"] is True
    assert reading["cpu_temp_c"] == pytest.approx(model.cpu_temp_c, abs=0.2)
    assert reading["throttled"] is False
    assert reading["ram_mb"] == model.profile.ram_kb // 1024


def test_a_heated_phone_reads_hot_and_throttled_with_a_lower_frequency(
        phone: tuple[PhoneModel, PhoneFiles]) -> None:
    model, files = phone
    probes = Probes(str(files.root), use_psutil=False)
    for _ in range(30):
        model.advance(1.0, 1.0)
    files.write(model)
    cool = probes.read()
    model.heat(20.0)
    for _ in range(120):
        model.advance(1.0, 1.0)
    files.write(model)
    hot = probes.read()
    assert hot["cpu_temp_c"] > 45 > cool["cpu_temp_c"]
    assert hot["throttled"] is True
    assert hot["cpu_freq_mhz"] < cool["cpu_freq_mhz"]
    assert float(files.slowdown_file.read_text()) > 1.3


def test_an_unplugged_phone_reads_discharging(phone: tuple[PhoneModel, PhoneFiles]) -> None:
    model, files = phone
    model.unplug()
    model.advance(1.0, 1.0)
    files.write(model)
    reading = Probes(str(files.root), use_psutil=False).read()
    assert reading["charging"] is False
    assert reading["power_w"] > 0


def test_an_unrooted_phone_shows_battery_through_termux_only(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model = PhoneModel(get_profile("nexus-5x-sd808"), battery_pct=15, plugged=False)
    files = PhoneFiles(tmp_path / "old", rooted=False)
    files.install(model)
    monkeypatch.setenv("PATH", files.env()["PATH"])
    assert not (files.root / "sys/class/power_supply").exists()
    reading = Probes(str(files.root), use_psutil=False).read()
    assert reading["battery_pct"] == 15
    assert reading["charging"] is False
    assert "cpu_temp_c" not in reading
    assert reading["battery_temp_c"] == pytest.approx(model.state.battery_c, abs=0.1)


def test_the_agent_enrolls_with_the_simulated_phones_hardware(
        phone: tuple[PhoneModel, PhoneFiles]) -> None:
    from agent.hardware import collect_spec
    from agent.probes.sysfs import SysfsRoot

    model, files = phone
    spec = collect_spec(SysfsRoot(files.root))
    assert spec["model"] == "SM-G975U"
    assert spec["soc"] == "SM8150"
    assert [len(c["cores"]) for c in spec["clusters"]] == [4, 3, 1]
