"""Request limits: a pure-ASGI body-size limit (413 before the body is read when Content-Length
says too much, and as soon as a streamed body passes it) and a per-device rate."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from typing import Any

from starlette.exceptions import HTTPException

Scope = dict[str, Any]


class BodyTooLarge(HTTPException):
    """An HTTPException so that FastAPI's body parsing passes it through as the 413 it is."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"request body larger than the {limit}-byte limit")


class BodySizeLimit:
    def __init__(self, app: Any, default_limit: int, upload_limit: int,
                 upload_paths: tuple[str, ...] = ()) -> None:
        self.app = app
        self.default_limit, self.upload_limit = default_limit, upload_limit
        self.upload_paths = upload_paths

    def _limit(self, path: str) -> int:
        return self.upload_limit if path in self.upload_paths else self.default_limit

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self._limit(scope["path"])
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            await _too_large(send, limit)
            return
        received = 0
        started = False

        async def limited_receive() -> dict[str, Any]:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    raise BodyTooLarge(limit)
            return message

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyTooLarge:
            if not started:
                await _too_large(send, limit)


async def _too_large(send: Any, limit: int) -> None:
    body = json.dumps({"detail": f"request body larger than the {limit}-byte limit"}).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


TRACKED_DEVICES = 100_000


class DeviceRate:
    """A token bucket per device: `per_minute` on average, `burst` at once. Only what a device
    was allowed to do is spent (after its token was checked), so requests naming a device with
    another token cannot use up the device's allowance."""

    def __init__(self, per_minute: float, burst: int, clock: Callable[[], float]) -> None:
        self.rate_s, self.burst, self.clock = per_minute / 60.0, float(burst), clock
        self._buckets: dict[str, tuple[float, float]] = {}  # device -> (tokens, at)
        self._lock = threading.Lock()

    def _level(self, device_id: str, now: float) -> float:
        tokens, at = self._buckets.get(device_id, (self.burst, now))
        # a wall clock stepped back must not leave a device refused for that long
        return min(self.burst, tokens + max(0.0, now - at) * self.rate_s)

    def wait_s(self, device_id: str) -> float:
        """Seconds until the device may send one more (0: now)."""
        with self._lock:
            level = self._level(device_id, self.clock())
        return 0.0 if level >= 1.0 else (1.0 - level) / self.rate_s

    def spend(self, device_id: str) -> None:
        with self._lock:
            now = self.clock()
            if device_id not in self._buckets and len(self._buckets) >= TRACKED_DEVICES:
                # a full bucket is what an unknown device gets: forgetting those loses nothing
                self._buckets = {d: b for d, b in self._buckets.items()
                                 if self._level(d, now) < self.burst}
            self._buckets[device_id] = (self._level(device_id, now) - 1.0, now)
