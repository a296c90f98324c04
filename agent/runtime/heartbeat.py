"""The heartbeat loop: renew the lease, ship telemetry in order, obey commands."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from agent import __version__
from agent.client import (
    RETRYABLE,
    Backoff,
    Client,
    Conflict,
    StatusError,
    Unauthorized,
    revoked_message,
)
from agent.probes import to_sample
from agent.runtime.buffer import TelemetryBuffer
from agent.runtime.monitor import Monitor
from agent.runtime.state import AgentState
from agent.runtime.upgrader import Upgrader
from wire.states import DeviceState

log = logging.getLogger(__name__)
BATCH = 100  # samples per request: an outage's backlog goes out in a few quick requests


class HeartbeatLoop:
    def __init__(self, client: Client, device_id: str, monitor: Monitor, state: AgentState,
                 buffer: TelemetryBuffer, capabilities: Callable[[], dict[str, Any]],
                 interval_s: float = 10.0, backoff: Backoff | None = None,
                 rotate_token: Callable[[], None] | None = None,
                 ship_logs: Callable[[], None] | None = None,
                 upgrader: Upgrader | None = None) -> None:
        self.client, self.device_id = client, device_id
        self.rotate_token, self.ship_logs, self.upgrader = rotate_token, ship_logs, upgrader
        self.rotation_asked = self.logs_asked = False
        self.upgrade_asked: dict[str, Any] | None = None
        self.monitor, self.state, self.buffer = monitor, state, buffer
        self.capabilities = capabilities
        self.interval_s = interval_s
        self.backoff = backoff or Backoff(base_s=1.0, cap_s=60.0)
        self.beats = 0

    def sample(self) -> None:
        """Take a reading into the buffer (also while offline: it is sent later, in order)."""
        self.buffer.append(to_sample(self.monitor.reading(fresh=True)))

    def body(self, telemetry: list[dict[str, Any]]) -> dict[str, Any]:
        pause = self.monitor.last_pause
        return {"telemetry": telemetry, "agent_version": __version__,
                "capabilities": self.capabilities(), "profiles": self.state.snapshot_profiles(),
                "pause": pause.to_json() if pause else None}

    def send(self) -> dict[str, Any]:
        """Send the buffer oldest first until empty; the last response."""
        resp: dict[str, Any] = {}
        while True:
            batch = self.buffer.peek(BATCH)
            try:
                resp = self.client.heartbeat(self.device_id, self.body(batch))
            except StatusError as exc:
                if 400 <= exc.status < 500 and not isinstance(exc, Unauthorized):
                    # the server will never take this batch: drop it, or it blocks all others
                    self.buffer.confirm(batch)
                raise
            self.buffer.confirm(batch)
            self.beats += 1
            if len(batch) < BATCH or not len(self.buffer):
                return resp

    def handle(self, resp: dict[str, Any]) -> None:
        interval = resp.get("heartbeat_interval_s")
        if isinstance(interval, (int, float)) and 0.05 <= interval <= 3600:
            self.interval_s = float(interval)
        self.state.device_state = resp.get("state")
        drain = resp.get("state") == DeviceState.DRAINING
        self.rotation_asked = self.logs_asked = False
        self.upgrade_asked = None
        for cmd in resp.get("commands") or []:
            kind = cmd.get("type") if isinstance(cmd, dict) else None
            if kind == "drain":
                drain = True
            elif kind == "profile" and isinstance(cmd.get("arch"), str):
                self.state.request_profile(cmd["arch"])
            elif kind == "rotate_token":
                self.rotation_asked = True
            elif kind == "logs":
                self.logs_asked = True
            elif kind == "upgrade":
                self.upgrade_asked = cmd
        self.state.draining = drain  # lifted when the server no longer asks for it

    def _rotate(self) -> None:
        """Rotate the device token; a token the server says was superseded (409: a rotation
        whose answer this agent never saved) can never rotate, so it stops asking: the token
        works until its grace period ends, then the phone must be enrolled again."""
        assert self.rotate_token is not None
        try:
            self.rotate_token()
        except Conflict as exc:
            self.rotate_token = None
            log.error("this device token cannot be rotated: %s. It keeps working until the "
                      "server's grace period ends; enroll this phone again before then",
                      exc.detail)

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set() and self.state.fatal is None:
            self.sample()
            try:
                self.handle(self.send())
                self.backoff.reset()
                wait = self.interval_s
                if self.rotation_asked and self.rotate_token is not None:
                    self._rotate()  # a failure is retried: the server asks again
                if self.logs_asked and self.ship_logs is not None:
                    self.ship_logs()  # likewise: asked again until the lines arrive
                if self.upgrader is not None:
                    self.upgrader.after_heartbeat()
                    if self.upgrade_asked is not None:
                        self.upgrader.handle(self.upgrade_asked, stop)
            except Unauthorized as exc:
                self.state.stop_for_good(revoked_message(exc))
                break
            except RETRYABLE as exc:
                wait = min(self.backoff.delay(), self.interval_s * 6)
                log.warning("heartbeat failed (%s); %d samples buffered; retry in %.1fs",
                            exc, len(self.buffer), wait)
            except StatusError as exc:
                wait = self.interval_s
                log.error("heartbeat rejected: %s", exc)
            if self.state.fatal is not None:
                break
            stop.wait(wait)
        if self.state.fatal is not None:
            stop.set()
