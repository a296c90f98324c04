"""Whole-body reads for the big uploads (gradient results: one model-sized vector each).

uvicorn hands a request body to the app in pieces of about 64 KB, and every piece travels up
through each middleware's `receive` wrapper and Starlette's request stream before it is joined:
a 12.9 MB upload (mobilenet_v1) is ~200 trips through the stack and two more copies. This
layer sits in front of the middleware stack and, for the upload paths only, reads a body whose
Content-Length is within the limit straight from the server into one buffer, then hands the
app a single `http.request` message. Everything after that (auth, limits, the route, errors)
is the normal stack, so answers do not change; a body without a Content-Length, or over the
limit, passes through untouched and is refused there as before.

No body is read for a request whose headers do not carry a valid device token (`admits`): it
passes through, and the route refuses it from its headers (401/403) without reading it, so a
stranger's upload costs the server its headers only. At most `max_bodies` bodies are held at
once per process; more wait for a place.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

# upload bodies read and checked at once per process, here and on the bulk listener (memory: at
# most 16 x the upload limit)
MAX_BODIES = 16


class WholeBodyReader:
    def __init__(self, app: Any, wants: Callable[[str], bool], limit: int,
                 admits: Callable[[dict[str, Any]], Awaitable[bool]],
                 max_bodies: int = MAX_BODIES) -> None:
        self.app, self.wants, self.limit, self.admits = app, wants, limit, admits
        self.places = asyncio.Semaphore(max_bodies)
        self.read = 0  # bodies read whole (for tests)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        length = self._length(scope)
        if length is None or not await self.admits(scope):
            await self.app(scope, receive, send)
            return
        async with self.places:
            chunks: list[bytes] = []
            while True:  # the server holds the body to Content-Length, so this ends within it
                message = await receive()
                if message["type"] == "http.disconnect":
                    return  # the client went away: nobody to answer, nothing was stored
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    break
            self.read += 1
            first: dict[str, Any] | None = {"type": "http.request", "body": b"".join(chunks),
                                            "more_body": False}

            async def replay() -> dict[str, Any]:
                nonlocal first
                if first is not None:
                    message, first = first, None
                    return message
                return await receive()  # after the body: only a disconnect can come

            await self.app(scope, replay, send)

    def _length(self, scope: dict[str, Any]) -> int | None:
        """The announced body length when this request is one to read whole, else None."""
        if scope["type"] != "http" or scope["method"] != "POST" or not self.wants(scope["path"]):
            return None
        for name, value in scope["headers"]:
            if name == b"content-length":
                if value.isdigit() and int(value) <= self.limit:
                    return int(value)
                return None
        return None
