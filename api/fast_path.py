"""The hot routes, served ahead of FastAPI's router and middleware.

Two requests are nearly all of a fleet's traffic: the heartbeat (10,000 phones every 10 s is
1,000 requests/s) and the work long poll (every agent, every step). On these machines
FastAPI's per-request layers (exception middlewares, the async exit stack, route matching over
every route, dependency solving, the request object) cost more Python than either request
itself: measured on the event loop at 8 agents, ~4 ms of CPU per work request, a quarter of
the server's CPU per step (docs/benchmarks.md). `FastPath` is a plain ASGI layer that answers
`POST /v1/devices/{id}/heartbeat` and `GET /v1/devices/{id}/work` directly and hands every
other request to the full stack. The FastAPI routes stay registered (OpenAPI documents them)
and run the same reply functions, so both paths give the same answers, the same errors and the
same status codes (tests/api/test_fast_path.py).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from fastapi.exceptions import RequestValidationError
from starlette.concurrency import run_in_threadpool

from api.app_state import AppState
from api.auth import parse_bearer
from api.deps import check_device
from api.error_responses import error_response
from api.limits import BodyTooLarge
from api.schemas.common import parse_body
from api.schemas.devices import HeartbeatIn
from api.steps.handlers import work_reply
from domain.errors import DomainError, TooManyRequests, Unauthorized
from domain.store.heartbeats import UnknownToken, check_clock

log = logging.getLogger(__name__)
JSON_HEADERS = [(b"content-type", b"application/json")]


@dataclass(frozen=True)
class Call:
    """What a fast route's reply function gets: the app's state, the path's device id, the
    Authorization header, the body (empty for a GET) and the ASGI scope."""

    state: AppState
    device_id: str
    authorization: str | None
    body: bytes
    scope: dict[str, Any]


@dataclass(frozen=True)
class FastRoute:
    method: str
    pattern: re.Pattern[str]
    path: str  # the route's template: what `api.metrics.RequestMetrics` reads off scope["route"]
    reply: Callable[[Call], Awaitable[bytes]]  # the answer's JSON, or raises an API error


async def heartbeat_reply(state: AppState, device_id: str, authorization: str | None,
                          raw_body: bytes) -> bytes:
    """Authenticate, validate, queue for the group commit, and return the reply's JSON once the
    batch is committed. The token is checked inside the batch's statement; the cache only
    short-circuits user/admin tokens and another device's token before any database work."""
    auth = state.authenticator
    token_hash, principal = auth.cached(parse_bearer(authorization))
    if principal is not None:
        check_device(principal, device_id)
    wait = state.heartbeat_rate.wait_s(device_id)
    if wait > 0:
        limit = state.settings.heartbeat_rate_per_minute
        raise TooManyRequests(f"device {device_id} sends heartbeats faster than {limit:g} a "
                              f"minute: the next in {wait:.1f} s", retry_after_s=wait)
    try:
        body = parse_body(HeartbeatIn, raw_body)
        check_clock(body, state.clock())
    except (RequestValidationError, DomainError):
        if principal is None:  # who asks comes first: a stranger's bad body is a 401, not a 422
            check_device(await run_in_threadpool(auth.lookup, token_hash), device_id)
        raise
    try:
        reply = await state.heartbeats.submit(device_id, token_hash, body)
    except UnknownToken:  # not a device token: 401 if unknown, 403 if a user/admin token
        check_device(await run_in_threadpool(auth.lookup, token_hash), device_id)
        raise Unauthorized("invalid bearer token") from None
    state.heartbeat_rate.spend(device_id)  # accepted, so the token was this device's
    return json.dumps(reply).encode()


async def _heartbeat(call: Call) -> bytes:
    return await heartbeat_reply(call.state, call.device_id, call.authorization, call.body)


async def _work(call: Call) -> bytes:
    return await work_reply(call.state, call.device_id, call.authorization, call.scope)


ROUTES = (
    FastRoute("POST", re.compile(r"/v1/devices/([^/]+)/heartbeat"),
              "/v1/devices/{device_id}/heartbeat", _heartbeat),
    FastRoute("GET", re.compile(r"/v1/devices/([^/]+)/work"),
              "/v1/devices/{device_id}/work", _work),
)


class _Disconnected(Exception):
    pass


class FastPath:
    def __init__(self, app: Any, state: AppState, body_limit: int,
                 routes: tuple[FastRoute, ...] = ROUTES) -> None:
        self.app, self.state, self.body_limit, self.routes = app, state, body_limit, routes

    def _match(self, scope: dict[str, Any]) -> tuple[FastRoute, re.Match[str]] | None:
        if scope["type"] != "http":
            return None
        for route in self.routes:
            if scope["method"] == route.method:
                match = route.pattern.fullmatch(scope["path"])
                if match is not None:
                    return route, match
        return None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        found = self._match(scope)
        if found is None:
            await self.app(scope, receive, send)
            return
        route, match = found
        scope["route"] = route  # api.metrics counts it under route.path, the template
        authorization, length = None, None
        for name, value in scope["headers"]:
            if name == b"authorization":
                authorization = value.decode("latin-1")
            elif name == b"content-length":
                length = value
        try:
            if length is not None and length.isdigit() and int(length) > self.body_limit:
                raise BodyTooLarge(self.body_limit)
            raw = await self._read_body(receive)
            status, payload, headers = 200, await route.reply(
                Call(self.state, match.group(1), authorization, raw, scope)), []
        except _Disconnected:  # nobody to answer; nothing was queued
            return
        except Exception as exc:
            mapped = error_response(exc)
            if mapped is None:
                raise
            status, detail, extra = mapped
            payload = json.dumps({"detail": detail}).encode()
            headers = [(name.lower().encode(), value.encode()) for name, value in extra.items()]
        await send({"type": "http.response.start", "status": status,
                    "headers": [*JSON_HEADERS, *headers,
                                (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})

    async def _read_body(self, receive: Any) -> bytes:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise _Disconnected
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.body_limit:
                raise BodyTooLarge(self.body_limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)
