"""Telemetry survives an outage: buffered (bounded), then sent oldest first."""

from __future__ import annotations

import itertools
import threading

from agent.client import Backoff, Client
from agent.runtime.buffer import TelemetryBuffer
from agent.runtime.heartbeat import HeartbeatLoop
from agent.runtime.monitor import Monitor
from agent.runtime.state import AgentState
from tests.agent.stepserver import TOKEN, StepServer


def counting_reader():
    counter = itertools.count()
    return lambda: {"ts": float(next(counter)), "battery_pct": 80.0}


def loop(server: StepServer, buffer: TelemetryBuffer) -> HeartbeatLoop:
    return HeartbeatLoop(Client(server.url, TOKEN), "dev-1", Monitor(counting_reader()),
                         AgentState(), buffer, lambda: {}, interval_s=0.02,
                         backoff=Backoff(base_s=0.01, cap_s=0.05))


def sent_ts(server: StepServer) -> list[float]:
    return [s["ts"] for hb in server.heartbeats for s in hb["telemetry"]]


def test_the_buffer_keeps_the_newest_samples_in_order() -> None:
    buf = TelemetryBuffer(maxlen=3)
    for i in range(10):
        buf.append({"ts": float(i)})
    assert [s["ts"] for s in buf.peek(10)] == [7.0, 8.0, 9.0]
    assert buf.dropped == 7
    buf.confirm(buf.peek(2))
    assert [s["ts"] for s in buf.peek(10)] == [9.0]


def test_samples_taken_during_an_outage_arrive_in_order_after_it() -> None:
    with StepServer() as server:
        server.fail_heartbeats = 15  # the control plane is down for 15 beats
        hb = loop(server, TelemetryBuffer(1000))
        stop = threading.Event()
        t = threading.Thread(target=hb.run, args=(stop,), daemon=True)
        t.start()
        server.wait_for(lambda: len(sent_ts(server)) >= 30, what="30 delivered samples")
        stop.set()
        t.join(timeout=30)
        ts = sent_ts(server)
        assert ts == sorted(ts) and len(ts) == len(set(ts))  # in order, none twice
        assert ts[0] == 0.0  # nothing from the outage was lost
        assert ts == [float(i) for i in range(len(ts))]
        assert len(server.heartbeats[0]["telemetry"]) >= 15  # the backlog came in the first beat


def test_a_long_outage_keeps_only_the_bound() -> None:
    with StepServer() as server:
        server.fail_heartbeats = 40
        hb = loop(server, TelemetryBuffer(5))
        stop = threading.Event()
        t = threading.Thread(target=hb.run, args=(stop,), daemon=True)
        t.start()
        server.wait_for(lambda: len(server.heartbeats) >= 1, what="the first accepted beat")
        stop.set()
        t.join(timeout=30)
        first = [s["ts"] for s in server.heartbeats[0]["telemetry"]]
        assert len(first) == 5  # the bound
        assert first == sorted(first) and first[0] >= 36  # the newest five of 41


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
    hb.handle({"state": "Ready", "commands": [{"type": "stop", "reason": "device deleted"}]})
    assert state.fatal == "device deleted"
