"""What the heartbeat and the work loop tell each other."""

from __future__ import annotations

import threading
from typing import Any


class AgentState:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.profiles: dict[str, dict[str, Any]] = {}
        self.draining = False
        self.fatal: str | None = None  # why the agent stopped for good (revoked, deleted)
        self.profile_requests: set[str] = set()
        self.device_state: str | None = None
        self.working = False  # the work loop holds an assignment

    def set_profile(self, arch: str, profile: dict[str, Any]) -> None:
        with self._lock:
            self.profiles[arch] = dict(profile)

    def snapshot_profiles(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {k: dict(v) for k, v in self.profiles.items()}

    def request_profile(self, arch: str) -> None:
        with self._lock:
            self.profile_requests.add(arch)

    def take_profile_request(self, arch: str) -> bool:
        with self._lock:
            if arch in self.profile_requests:
                self.profile_requests.discard(arch)
                return True
            return False

    def stop_for_good(self, why: str) -> None:
        with self._lock:
            if self.fatal is None:
                self.fatal = why
