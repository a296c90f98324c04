"""Simulated phones running the real agent against a real server and scheduler: a phone whose
cooling fails throttles and its shards move; an unplugged phone that drains below the job's
min_battery stops training and its shards move; a phone that loses its network goes NotReady
and comes back Ready when the network does. One job, observed once for all the tests."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from phalanx.demo.server import DEMO_SETTINGS
from phalanx.sim.phone import PhoneOptions, PhoneRack, SimulatedPhone
from phalanx.sim.profiles import get_profile
from tests.support.databases import migrated_sqlite
from tests.support.env import ADMIN_TOKEN
from tests.support.server import start_server

JOB = {
    "name": "long-enough", "model": {"arch": "cnn"}, "dataset": "digits",
    "global_batch_size": 128, "shards": 8, "epochs": 200,
    "placement": {"min_devices": 1, "max_devices": 4, "selector": {"rack": "t"},
                  "min_battery": 20, "max_temp_c": 45},
    "verification": {"audit_rate": 0.0, "probation_steps": 0},  # audits: tests/e2e/test_liar.py
}


@dataclass
class Seen:
    """What the control plane showed while the scenario ran."""

    hot: dict[str, Any] = field(default_factory=dict)  # the hot phone, once paused
    hot_before: dict[str, Any] = field(default_factory=dict)
    hot_cap_khz: tuple[int, int] = (0, 0)  # scaling_max_freq of the prime core: before, after
    drained: dict[str, Any] = field(default_factory=dict)
    job_devices: list[list[str]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    ids: dict[str, str] = field(default_factory=dict)
    cut_states: list[str] = field(default_factory=list)  # the cut phone's states, in order


def poll(client: httpx.Client, check: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check(client)
        if got:
            return got
        time.sleep(0.5)
    pytest.fail(f"not within {timeout_s}s: {what}")


def prime_cap_khz(phone: SimulatedPhone) -> int:
    path = phone.files.root / "sys/devices/system/cpu/cpu7/cpufreq/scaling_max_freq"
    return int(path.read_text())


@pytest.fixture(scope="module")
def seen(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Seen]:
    base = tmp_path_factory.mktemp("phones")
    server = start_server(database_url=migrated_sqlite(base / "db.sqlite"), data_dir=base / "data",
                          admin_token=ADMIN_TOKEN, extra_env=dict(DEMO_SETTINGS))
    sd855 = get_profile("galaxy-s10plus-sd855")
    phones = [
        SimulatedPhone("hot", sd855, base / "hot", PhoneOptions(time_scale=30, labels={"rack": "t"})),
        SimulatedPhone("drained", sd855, base / "drained", PhoneOptions(
            battery_pct=45, plugged=False, time_scale=400, labels={"rack": "t"})),
        SimulatedPhone("steady", sd855, base / "steady", PhoneOptions(labels={"rack": "t"})),
        SimulatedPhone("cut", sd855, base / "cut", PhoneOptions(labels={"rack": "t"})),
    ]
    rack = PhoneRack(phones, period_s=0.25)
    seen = Seen()
    try:
        with server.client() as admin:
            token = admin.post("/v1/enrollment-tokens", json={}).json()["token"]
            for phone in phones:
                phone.enroll(server.url, token)
            seen.ids = {p.name: str(p.device_id) for p in phones}
            rack.start()
            job = admin.post("/v1/jobs", json=JOB).json()
            poll(admin, lambda c: seen.ids["hot"] in c.get(f"/v1/jobs/{job['id']}").json()["devices"],
                 90, "the job placed on the hot phone")
            seen.hot_before = admin.get(f"/v1/devices/{seen.ids['hot']}").json()
            before_khz = prime_cap_khz(phones[0])
            phones[0].heat(20.0)
            phones[3].set_online(False)

            def cut_state(c: httpx.Client, want: str) -> bool:
                state = c.get(f"/v1/devices/{seen.ids['cut']}").json()["state"]
                if not seen.cut_states or seen.cut_states[-1] != state:
                    seen.cut_states.append(state)
                return state == want

            def hot_paused(c: httpx.Client) -> dict[str, Any] | None:
                dev = c.get(f"/v1/devices/{seen.ids['hot']}").json()
                return dev if dev.get("pause_reason") == "thermal" else None

            seen.hot = poll(admin, hot_paused, 90, "the hot phone pauses (thermal)")
            seen.hot_cap_khz = (before_khz, prime_cap_khz(phones[0]))

            def drained(c: httpx.Client) -> dict[str, Any] | None:
                dev = c.get(f"/v1/devices/{seen.ids['drained']}").json()
                return dev if dev.get("pause_reason") == "battery" else None

            seen.drained = poll(admin, drained, 120, "the unplugged phone pauses (battery)")
            poll(admin, lambda c: cut_state(c, "NotReady"), 60, "the cut phone goes NotReady")
            phones[3].set_online(True)
            poll(admin, lambda c: cut_state(c, "Ready"), 120, "the cut phone comes back Ready")

            def moved_off(c: httpx.Client) -> list[str] | None:
                devices = c.get(f"/v1/jobs/{job['id']}").json()["devices"]
                seen.job_devices.append(devices)
                off = seen.ids["hot"] not in devices and seen.ids["drained"] not in devices
                return devices if off and devices else None

            poll(admin, moved_off, 90, "both phones' shards moved away")
            seen.events = admin.get(f"/v1/jobs/{job['id']}/events").json()["items"]
            admin.post(f"/v1/jobs/{job['id']}/cancel")
        yield seen
    finally:
        server.process.terminate()  # both at once: the server drains the agents' long polls
        rack.stop()
        server.stop()


def moved_from(seen: Seen) -> set[str]:
    """The devices ShardsMoved events took shards from."""
    return {device for e in seen.events if e["reason"] == "ShardsMoved"
            for device in (e.get("data") or {}).get("from", [])}


@pytest.mark.slow
def test_a_phone_whose_cooling_fails_throttles_and_its_shards_move(seen: Seen) -> None:
    cool, hot = seen.hot_before["latest_telemetry"], seen.hot["latest_telemetry"]
    assert cool.get("throttled") is not True
    assert hot["throttled"] is True
    assert hot["cpu_temp_c"] > 45
    cap_before, cap_after = seen.hot_cap_khz
    assert cap_after < 0.95 * cap_before  # the governor capped the prime core
    # the scheduler moved its shards away, and said so: a ShardsMoved event names it
    assert seen.ids["hot"] in moved_from(seen)
    assert seen.ids["steady"] in seen.job_devices[-1]


@pytest.mark.slow
def test_an_unplugged_phone_below_min_battery_stops_and_its_shards_move(seen: Seen) -> None:
    t = seen.drained["latest_telemetry"]
    assert t["charging"] is False
    assert t["battery_pct"] < 20
    assert seen.ids["drained"] in moved_from(seen)


@pytest.mark.slow
def test_a_phone_that_loses_its_network_goes_not_ready_and_comes_back(seen: Seen) -> None:
    states = seen.cut_states
    assert "NotReady" in states
    assert states[-1] == "Ready"
    assert states.index("NotReady") < len(states) - 1
