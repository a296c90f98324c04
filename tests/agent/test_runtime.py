"""The agent's runtime end to end over real HTTP: steps, phone-first guard, profiles, restarts."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from agent.runtime.agent import AgentStopped
from tests.agent import phone
from tests.agent.helpers import AgentThread, agent_process, write_config
from tests.agent.stepserver import JOB_SPEC, TOKEN, StepServer

CPU_ZONES = ("/sys/class/thermal/thermal_zone0/temp", "/sys/class/thermal/thermal_zone1/temp")


def set_cpu_temp(root: Path, celsius: float) -> None:
    for zone in CPU_ZONES:
        phone.set_value(root, zone, int(celsius * 1000))


@pytest.fixture
def cool_phone(rooted: Path) -> Path:
    set_cpu_temp(rooted, 40.0)
    return rooted


def last_pause(server: StepServer) -> dict | None:
    return server.heartbeats[-1].get("pause") if server.heartbeats else None


def test_the_agent_trains_reports_its_profile_and_uploads_each_shard_once(
    tmp_path: Path, cool_phone: Path
) -> None:
    with StepServer() as server:
        server.max_steps = 4
        cfg = write_config(tmp_path / "agent.json", server.url, TOKEN)
        with AgentThread(cfg, cool_phone):
            server.wait_for(lambda: server.state.step >= 4, what="four applied steps")
            server.wait_for(lambda: "logreg" in server.heartbeats[-1].get("profiles", {}),
                            what="a profile in the heartbeat")
        assert server.duplicates == 0
        assert len(server.uploads) == 4 * server.spec.shards
        profile = server.heartbeats[-1]["profiles"]["logreg"]
        assert profile["samples_per_s"] > 0 and profile["backend"] == "numpy"
        assert profile["threads"] >= 1
        sample = server.heartbeats[-1]["telemetry"][-1]
        assert sample["battery_pct"] == 87 and sample["cpu_temp_c"] == 40.0
        assert server.losses[-1] < server.losses[0]  # it really trains


@pytest.mark.parametrize("wanted, used", [("any", "numpy"), ("torch", "torch")])
def test_every_phone_of_a_job_computes_with_the_jobs_one_backend(
    tmp_path: Path, cool_phone: Path, wanted: str, used: str
) -> None:
    """numpy and torch round differently: a job's phones never mix them (invariant 1)."""
    spec = {**JOB_SPEC, "placement": {**JOB_SPEC["placement"], "backend": wanted}}
    with StepServer(spec) as server:
        server.max_steps = 2
        cfg = write_config(tmp_path / "agent.json", server.url, TOKEN, backends=["numpy", "torch"])
        with AgentThread(cfg, cool_phone):
            server.wait_for(lambda: server.heartbeats and "logreg" in
                            server.heartbeats[-1].get("profiles", {}),
                            what="a profile in the heartbeat")
        profile = server.heartbeats[-1]["profiles"]["logreg"]
        assert profile["backend"] == used
        assert server.heartbeats[-1]["capabilities"]["backends"] == ["numpy", "torch"]


def test_the_thermal_guard_stops_steps_and_resumes_with_hysteresis(
    tmp_path: Path, cool_phone: Path
) -> None:
    with StepServer() as server:
        cfg = write_config(tmp_path / "agent.json", server.url, TOKEN)
        with AgentThread(cfg, cool_phone):
            server.wait_for(lambda: server.state.step >= 1, what="a first step")
            set_cpu_temp(cool_phone, 50.0)  # above the job's max_temp_c 45
            server.wait_for(lambda: (last_pause(server) or {}).get("reason") == "thermal",
                            what="a thermal pause in the heartbeat")
            assert "cpu 50.0 C > max_temp_c 45" in last_pause(server)["detail"]
            frozen = len(server.uploads)
            beats = len(server.heartbeats)
            set_cpu_temp(cool_phone, 44.0)  # below the limit, not below limit - hysteresis
            server.wait_for(lambda: len(server.heartbeats) >= beats + 20, what="20 heartbeats")
            # at most the chunk in flight when the heat came may still land (a chunk is up to
            # a whole step's shards for a model this small)
            assert len(server.uploads) <= frozen + server.spec.shards
            assert last_pause(server)["reason"] == "thermal"
            set_cpu_temp(cool_phone, 41.0)
            server.wait_for(lambda: last_pause(server) is None, what="the pause lifted")
            server.wait_for(lambda: len(server.uploads) > frozen + 4, what="steps resumed")


def test_a_discharging_phone_below_min_battery_pauses(tmp_path: Path, cool_phone: Path) -> None:
    phone.set_value(cool_phone, "/sys/class/power_supply/battery/capacity", 12)
    phone.set_value(cool_phone, "/sys/class/power_supply/battery/status", "Discharging")
    phone.set_value(cool_phone, "/sys/class/power_supply/usb/online", 0)
    with StepServer() as server:
        cfg = write_config(tmp_path / "agent.json", server.url, TOKEN)
        with AgentThread(cfg, cool_phone):
            server.wait_for(lambda: (last_pause(server) or {}).get("reason") == "battery",
                            what="a battery pause")
            beats = len(server.heartbeats)
            server.wait_for(lambda: len(server.heartbeats) >= beats + 10, what="10 heartbeats")
            assert server.uploads == []
            phone.set_value(cool_phone, "/sys/class/power_supply/usb/online", 1)  # plugged in
            server.wait_for(lambda: len(server.uploads) > 0, what="training once plugged in")


def test_shared_mode_pauses_while_the_screen_is_on(tmp_path: Path, cool_phone: Path) -> None:
    phone.write(cool_phone, "/sys/class/backlight/panel0-backlight/brightness", "128")
    with StepServer() as server:
        cfg = write_config(tmp_path / "agent.json", server.url, TOKEN, shared_mode=True)
        with AgentThread(cfg, cool_phone):
            server.wait_for(lambda: (last_pause(server) or {}).get("reason") == "busy",
                            what="a busy pause")
            assert "screen on" in last_pause(server)["detail"]
            assert server.uploads == []


def test_a_revoked_token_stops_the_agent_with_a_clear_message(
    tmp_path: Path, cool_phone: Path
) -> None:
    with StepServer() as server:
        server.revoked = True
        cfg = write_config(tmp_path / "agent.json", server.url, TOKEN)
        agent = AgentThread(cfg, cool_phone)
        with agent:
            agent.thread.join(timeout=60)
        assert isinstance(agent.error, AgentStopped)
        assert "revoked" in str(agent.error) and "enroll" in str(agent.error)


def test_a_killed_agent_restarts_cleanly_and_never_uploads_a_shard_twice(
    tmp_path: Path, cool_phone: Path
) -> None:
    with StepServer() as server:
        cfg = write_config(tmp_path / "agent.json", server.url, TOKEN)
        log = tmp_path / "agent.log"
        proc = agent_process(cfg, cool_phone, log)
        try:
            server.wait_for(lambda: server.state.step >= 2, 90, "two steps by the first run")
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
        before = len(server.uploads)
        # what a kill can leave: a half-written temp config, a damaged cache, a torn ledger line
        (cfg.parent / f".{cfg.name}.abc123.tmp").write_text('{"server": "http://x", "dev')
        state = cfg.with_name(cfg.stem + ".state")
        for shard in (state / "cache").rglob("shard-*.npz"):
            shard.write_bytes(shard.read_bytes()[:100])
        with (state / "uploads.jsonl").open("a") as fh:
            fh.write('{"job": "job-test", "st')
        proc = agent_process(cfg, cool_phone, log)
        try:
            server.wait_for(lambda: len(server.uploads) >= before + 2 * server.spec.shards, 90,
                            "steps by the restarted agent")
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        assert server.duplicates == 0, log.read_text()
        assert proc.returncode == 0, log.read_text()
        assert json.loads(cfg.read_text())["device_id"] == "dev-1"
        assert not list(cfg.parent.glob(f".{cfg.name}.*.tmp"))
        assert os.stat(cfg).st_mode & 0o777 == 0o600
