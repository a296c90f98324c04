"""A pure-ASGI body-size limit: 413 before the body is read when Content-Length says too much,
and 413 as soon as a streamed (chunked) body passes the limit."""

from __future__ import annotations

import json
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
