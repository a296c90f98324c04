"""The agent holding a superseded device token (issue 42, item 7): the server asks it to rotate
(its token has an end) but answers the rotation 409. The agent stops asking, says what to do,
and goes on with everything else its heartbeats ask (logs, upgrades), instead of failing every
heartbeat from then on."""

from __future__ import annotations

import logging
import threading
from typing import Any

from agent.client import Client, Conflict
from agent.runtime.buffer import TelemetryBuffer
from agent.runtime.heartbeat import HeartbeatLoop
from agent.runtime.monitor import Monitor
from agent.runtime.state import AgentState
from tests.agent.test_heartbeat import counting_reader
from tests.support.waiting import wait_for

SUPERSEDED = ("this device token was superseded by a rotation: it works for the device's calls "
              "until 2026-12-07T10:00:00+00:00, but only the newest token may rotate")


class SupersededServer(Client):
    """A control plane whose every heartbeat asks for a rotation and the logs, and whose
    rotation refuses this (superseded) token."""

    def __init__(self) -> None:
        super().__init__("http://127.0.0.1:1", "phx-dev-old")
        self.beats = self.rotations = 0

    def heartbeat(self, device_id: str, body: dict[str, Any]) -> dict[str, Any]:
        self.beats += 1
        return {"state": "Ready", "heartbeat_interval_s": 0.05,
                "commands": [{"type": "rotate_token"}, {"type": "logs"}]}

    def rotate_token(self, device_id: str) -> dict[str, Any]:
        self.rotations += 1
        raise Conflict(409, SUPERSEDED, f"/v1/devices/{device_id}/token")


def test_a_refused_rotation_is_not_asked_again_and_the_rest_goes_on(caplog) -> None:
    server = SupersededServer()
    shipped: list[int] = []
    hb = HeartbeatLoop(server, "dev-1", Monitor(counting_reader()), AgentState(),
                       TelemetryBuffer(10), lambda: {}, interval_s=0.05,
                       rotate_token=lambda: server.rotate_token("dev-1"),
                       ship_logs=lambda: shipped.append(server.beats))
    stop = threading.Event()
    thread = threading.Thread(target=hb.run, args=(stop,), daemon=True)
    with caplog.at_level(logging.INFO, logger="agent.runtime.heartbeat"):
        thread.start()
        try:
            wait_for("five heartbeats", lambda: server.beats >= 5, timeout=10)
        finally:
            stop.set()
            thread.join(10)
    assert server.beats >= 5
    assert server.rotations == 1  # asked once, never again in this process
    assert len(shipped) >= 4  # the logs the server asked for went out on every beat
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert any("cannot be rotated" in m and "enroll this phone again" in m for m in errors)
    assert not any("heartbeat rejected" in m for m in errors), errors
    assert hb.state.fatal is None
