"""The agent's runtime against the real control plane (`phalanx server`, embedded mode): steps,
the phone-first guards, profiles and backends, a kill and a restart. What the server saw is read
through its API and its /metrics, as an operator would."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.agent import phone
from tests.agent.helpers import AgentThread
from tests.agent.live import (
    Phone,
    cancel,
    enroll,
    job,
    live_server,
    running,
    set_cpu_temp,
    shard_results,
    submit,
)
from tests.support.server import LiveServer


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    yield from live_server(tmp_path_factory.mktemp("server"))


def paused_events(p: Phone) -> list[str]:
    return [e["message"] for e in p.events() if e["reason"] == "Paused"]


def test_the_agent_trains_reports_its_profile_and_uploads_each_shard_once(
        server: LiveServer, tmp_path: Path, cool_phone: Path) -> None:
    with running(enroll(server, tmp_path, cool_phone)) as p:
        before = shard_results(server)
        job_id = submit(server, p.job_spec())
        done = p.wait("the job to finish", lambda: (
            (j := job(server, job_id))["state"] in ("Succeeded", "Failed") and j), timeout=180)
        assert done["state"] == "Succeeded", done
        profile = p.wait("a logreg profile", lambda: p.device()["profiles"].get("logreg"))
    after = shard_results(server)
    assert after["accepted"] - before["accepted"] == done["total_steps"] * 4  # every shard, once
    assert after["duplicate"] == before["duplicate"]
    with server.client() as c:
        curve = c.get(f"/v1/jobs/{job_id}/metrics").json()["items"]
    assert curve[-1]["train_loss"] < curve[0]["train_loss"]  # it really trains
    assert profile["samples_per_s"] > 0 and profile["backend"] == "numpy"
    assert profile["threads"] >= 1
    latest = p.device()["latest_telemetry"]
    assert latest["battery_pct"] == 87 and latest["cpu_temp_c"] == 40.0


def test_slices_fetched_ahead_of_a_step_that_never_comes_are_let_go(
        server: LiveServer, tmp_path: Path, cool_phone: Path) -> None:
    """A sliced job: the phone fetches each next step's slices as they are applied and uses
    them; after the last step it has fetched the slices of a step that never comes, a model's
    worth it lets go once a long poll finds no work (not at the next sliced job, if ever)."""
    p = enroll(server, tmp_path, cool_phone)
    with AgentThread(p.config, cool_phone) as agent:
        job_id = submit(server, p.job_spec(slices=2, epochs=1))
        done = p.wait("the job to finish", lambda: (
            (j := job(server, job_id))["state"] in ("Succeeded", "Failed") and j), timeout=180)
        assert done["state"] == "Succeeded", done
        fetcher = agent.runtime.work.slices
        assert fetcher.fetched_ahead > 0  # next steps' slices came ahead and were used
        p.wait("the slices fetched after the last step let go",
               lambda: fetcher.held_bytes() == 0, timeout=30)
    assert agent.error is None, agent.error


@pytest.mark.parametrize(("wanted", "used"), [("any", "numpy"), ("torch", "torch")])
def test_every_phone_of_a_job_computes_with_the_jobs_one_backend(
        server: LiveServer, tmp_path: Path, cool_phone: Path, wanted: str, used: str) -> None:
    """numpy and torch round differently: a job's phones never mix them (invariant 1)."""
    with running(enroll(server, tmp_path, cool_phone, backends=["numpy", "torch"])) as p:
        job_id = submit(server, p.job_spec(placement={"backend": wanted}))
        profile = p.wait("a logreg profile", lambda: p.device()["profiles"].get("logreg"),
                         timeout=120)
        p.wait("a step computed", lambda: job(server, job_id)["step"] >= 1)
        cancel(server, job_id)
    assert profile["backend"] == used
    assert p.device()["capabilities"]["backends"] == ["numpy", "torch"]


def test_the_thermal_guard_stops_steps_and_resumes_with_hysteresis(
        server: LiveServer, tmp_path: Path, cool_phone: Path) -> None:
    with running(enroll(server, tmp_path, cool_phone)) as p:
        job_id = submit(server, p.job_spec(epochs=40))
        p.wait("a first step", lambda: job(server, job_id)["step"] >= 1)
        set_cpu_temp(cool_phone, 50.0)  # above the job's max_temp_c 45
        p.wait("a thermal pause", lambda: p.device()["pause_reason"] == "thermal")
        assert any("cpu 50.0 C > max_temp_c 45" in m for m in paused_events(p)), p.events()
        frozen = job(server, job_id)["step"]
        set_cpu_temp(cool_phone, 44.0)  # below the limit, not below limit - hysteresis
        p.wait("ten heartbeats at 44 C",
               lambda: sum(s["cpu_temp_c"] == 44.0 for s in p.telemetry()) >= 10)
        assert p.device()["pause_reason"] == "thermal"
        # at most the step in flight when the heat came may still be applied
        assert job(server, job_id)["step"] <= frozen + 1
        set_cpu_temp(cool_phone, 41.0)
        p.wait("the pause lifted", lambda: p.device()["pause_reason"] is None)
        p.wait("steps resumed", lambda: job(server, job_id)["step"] > frozen + 2)
        cancel(server, job_id)


def test_a_discharging_phone_below_min_battery_pauses(
        server: LiveServer, tmp_path: Path, cool_phone: Path) -> None:
    phone.set_value(cool_phone, "/sys/class/power_supply/battery/capacity", 12)
    phone.set_value(cool_phone, "/sys/class/power_supply/battery/status", "Discharging")
    phone.set_value(cool_phone, "/sys/class/power_supply/usb/online", 0)
    with running(enroll(server, tmp_path, cool_phone)) as p:
        job_id = submit(server, p.job_spec())
        p.wait("a battery pause", lambda: p.device()["pause_reason"] == "battery")
        p.wait("ten heartbeats at 12%",
               lambda: sum(s["battery_pct"] == 12 for s in p.telemetry()) >= 10)
        assert job(server, job_id)["step"] == 0
        phone.set_value(cool_phone, "/sys/class/power_supply/usb/online", 1)  # plugged in
        p.wait("training once plugged in", lambda: job(server, job_id)["step"] >= 1)
        cancel(server, job_id)


def test_shared_mode_pauses_while_the_screen_is_on(
        server: LiveServer, tmp_path: Path, cool_phone: Path) -> None:
    phone.write(cool_phone, "/sys/class/backlight/panel0-backlight/brightness", "128")
    # a 3 s quiet period after the user leaves (30 s by default): the same path, sooner
    with running(enroll(server, tmp_path, cool_phone, shared_mode=True, busy_quiet_s=3.0)) as p:
        job_id = submit(server, p.job_spec())
        p.wait("a busy pause", lambda: p.device()["pause_reason"] == "busy")
        assert any("screen on" in m for m in paused_events(p)), p.events()
        p.wait("four heartbeats while busy", lambda: len(p.telemetry()) >= 4)
        assert job(server, job_id)["step"] == 0  # nothing computed while the user is on it
        phone.write(cool_phone, "/sys/class/backlight/panel0-backlight/brightness", "0")
        p.wait("training once the screen is off", lambda: job(server, job_id)["step"] >= 1)
        cancel(server, job_id)


def test_a_killed_agent_restarts_cleanly_and_never_uploads_a_shard_twice(
        server: LiveServer, tmp_path: Path, cool_phone: Path) -> None:
    p = enroll(server, tmp_path, cool_phone).start()
    before = shard_results(server)
    job_id = submit(server, p.job_spec(epochs=40))
    try:
        p.wait("two steps by the first run", lambda: job(server, job_id)["step"] >= 2)
        assert p.process is not None
        p.process.send_signal(signal.SIGKILL)  # Android's phantom process killer
        p.process.wait(timeout=30)
        step = job(server, job_id)["step"]
        # what a kill can leave: a half-written temp config, a damaged cache, a torn ledger line
        cfg = p.config
        (cfg.parent / f".{cfg.name}.abc123.tmp").write_text('{"server": "http://x", "dev')
        state = cfg.with_name(cfg.stem + ".state")
        for shard in (state / "cache").rglob("shard-*.npz"):
            shard.write_bytes(shard.read_bytes()[:100])
        with (state / "uploads.jsonl").open("a") as fh:
            fh.write('{"job": "' + job_id + '", "st')
        p.start()
        p.wait("two steps by the restarted agent", lambda: job(server, job_id)["step"] >= step + 2)
        cancel(server, job_id)
    finally:
        code = p.stop()
    assert code == 0, p.logs()
    assert shard_results(server)["duplicate"] == before["duplicate"], p.logs()
    assert json.loads(cfg.read_text())["device_id"] == p.device_id
    assert not list(cfg.parent.glob(f".{cfg.name}.*.tmp"))
    assert os.stat(cfg).st_mode & 0o777 == 0o600
