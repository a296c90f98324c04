"""Telemetry survives an outage: buffered (bounded), then sent oldest first."""

from __future__ import annotations

import datetime as dt
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from agent.client import Backoff, Client
from agent.runtime.buffer import TelemetryBuffer
from agent.runtime.heartbeat import HeartbeatLoop
from agent.runtime.monitor import Monitor
from agent.runtime.state import AgentState
from tests.support.databases import migrated_sqlite
from tests.support.env import ADMIN_TOKEN as ADMIN
from tests.support.server import LiveServer, free_port, start_server
from tests.support.waiting import wait_for

TOKEN = "phx-dev-never-sent"  # the commands test handles replies; it sends nothing


BASE_TS = time.time() - 3600.0  # an hour ago: real timestamps, one second apart


def counting_reader():
    counter = itertools.count()
    return lambda: {"ts": BASE_TS + next(counter), "battery_pct": 80.0}


@dataclass
class Outage:
    """A device registered on a real `phalanx server` whose process is then stopped: the
    control plane is down until `restore()` starts it again on the same port and database."""

    url: str
    port: int
    device_id: str
    token: str
    start: Callable[[], LiveServer]
    server: LiveServer | None = None

    def restore(self) -> LiveServer:
        self.server = self.start()
        return self.server

    def history(self) -> list[float]:
        assert self.server is not None
        with self.server.client() as c:
            items = c.get(f"/v1/devices/{self.device_id}/telemetry",
                          params={"limit": 1000}).json()["items"]
        return [dt.datetime.fromisoformat(i["ts"]).timestamp() for i in items]


@pytest.fixture
def outage(tmp_path: Path) -> Iterator[Outage]:
    port, db = free_port(), migrated_sqlite(tmp_path / "phalanx.sqlite")

    def start() -> LiveServer:
        return start_server(database_url=db, data_dir=tmp_path / "data", admin_token=ADMIN,
                            port=port, args=["--bulk-port", "0"])

    first = start()
    with first.client() as c:
        enrollment = c.post("/v1/enrollment-tokens", json={}).json()["token"]
    body = {"enrollment_token": enrollment, "name": "p", "labels": {}, "spec": {}}
    reg = httpx.post(f"{first.url}/v1/devices/register", json=body, timeout=30).json()
    first.stop()
    down = Outage(first.url, port, reg["device_id"], reg["device_token"], start)
    yield down
    if down.server is not None:
        down.server.stop()


def run_loop(outage: Outage, buffer: TelemetryBuffer) -> tuple[HeartbeatLoop, threading.Event,
                                                               threading.Thread]:
    hb = HeartbeatLoop(Client(outage.url, outage.token), outage.device_id,
                       Monitor(counting_reader()), AgentState(), buffer, lambda: {},
                       interval_s=0.02, backoff=Backoff(base_s=0.01, cap_s=0.05))
    stop = threading.Event()
    thread = threading.Thread(target=hb.run, args=(stop,), daemon=True)
    thread.start()
    return hb, stop, thread


def test_the_buffer_keeps_the_newest_samples_in_order() -> None:
    buf = TelemetryBuffer(maxlen=3)
    for i in range(10):
        buf.append({"ts": float(i)})
    assert [s["ts"] for s in buf.peek(10)] == [7.0, 8.0, 9.0]
    assert buf.dropped == 7
    buf.confirm(buf.peek(2))
    assert [s["ts"] for s in buf.peek(10)] == [9.0]


def test_samples_taken_during_an_outage_arrive_after_it_none_lost_none_twice(
        outage: Outage) -> None:
    buffer = TelemetryBuffer(1000)
    _, stop, thread = run_loop(outage, buffer)
    try:
        wait_for("15 samples buffered while the server is down", lambda: len(buffer) >= 15)
        outage.restore()
        wait_for("30 samples stored", lambda: len(outage.history()) >= 30)
    finally:
        stop.set()
        thread.join(timeout=30)
    ts = outage.history()
    # every sample from the first one on, each once: nothing from the outage was lost
    assert ts == pytest.approx([BASE_TS + i for i in range(len(ts))], abs=1e-3)


def test_a_long_outage_keeps_only_the_bound(outage: Outage) -> None:
    buffer = TelemetryBuffer(5)
    _, stop, thread = run_loop(outage, buffer)
    try:
        wait_for("35 samples dropped while the server is down", lambda: buffer.dropped >= 35)
        outage.restore()
        wait_for("the backlog stored", lambda: len(outage.history()) >= 5)
    finally:
        stop.set()
        thread.join(timeout=30)
    ts = outage.history()
    # the oldest were dropped; the newest five of the outage and everything after arrived
    assert buffer.dropped >= 35
    assert ts == pytest.approx([BASE_TS + buffer.dropped + i for i in range(len(ts))], abs=1e-3)


def test_commands_from_the_control_plane_are_obeyed() -> None:
    state = AgentState()
    hb = HeartbeatLoop(Client("http://127.0.0.1:1", TOKEN), "dev-1", Monitor(counting_reader()),
                       state, TelemetryBuffer(10), lambda: {})
    hb.handle({"state": "Draining", "heartbeat_interval_s": 2.5,
               "commands": [{"type": "drain"}, {"type": "profile", "arch": "cnn"}]})
    assert state.draining and hb.interval_s == 2.5
    assert state.take_profile_request("cnn") and not state.take_profile_request("cnn")
    hb.handle({"state": "Ready", "commands": []})
    assert not state.draining  # uncordoned: work again
    # unknown commands are ignored (there is no `stop`: a deleted device gets 401, below)
    hb.handle({"state": "Ready", "commands": [{"type": "stop", "reason": "device deleted"}]})
    assert state.fatal is None and not state.draining


def test_the_compute_class_is_reported_bounded_or_not_at_all(monkeypatch) -> None:
    """The agent's `capabilities.compute_class`: this machine's facts, each cut to what the
    control plane takes; a fingerprint that is not 16 hex digits (or an engine that cannot
    tell) leaves it out, so the heartbeat itself is never refused for it."""
    import engine.compute_class
    from agent.runtime import agent

    facts = agent.compute_class()
    assert facts is not None and facts["fingerprint"] == engine.compute_class.fingerprint()
    long = {**engine.compute_class.describe(), "numpy": "2." + "9" * 100, "simd_features": 5000}
    monkeypatch.setattr(engine.compute_class, "describe", lambda: long)
    cut = agent.compute_class()
    assert cut is not None and len(cut["numpy"]) == 64 and cut["simd_features"] == 1024
    monkeypatch.setattr(engine.compute_class, "describe", lambda: {**long, "fingerprint": "XY"})
    assert agent.compute_class() is None

    def broken() -> dict:
        raise RuntimeError("no BLAS")

    monkeypatch.setattr(engine.compute_class, "describe", broken)
    assert agent.compute_class() is None
    assert "portable" in agent.FEATURES
