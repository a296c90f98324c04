"""No body is read before its sender is known: a pure-ASGI gate in front of everything that
reads bodies (the heartbeat's fast path, the upload reader, FastAPI's parameter parsing).

FastAPI reads and parses a route's body (JSON, and a multipart form spooled to disk) before
it resolves the route's dependencies, auth among them; the fast path reads the heartbeat's
body before it looks at the token. So a stranger who announces a large body and trickles it
would hold the server until the body arrived, and only then be told 401. Here, a request that
announces a body (a Content-Length above 0, or a Transfer-Encoding) must carry a valid bearer
token of any kind, checked from its headers alone (a token found valid within the last
`api.auth.VOUCHED_TTL_S`, else one lookup); without one it is answered 401 at once with
`Connection: close`, its body never read. What kind of token a route needs (403), and whether
it is still valid now (revoked, expired), is still the route's to say: a phone heartbeating
every 10 s, past the 5 s token cache, costs no lookup here ahead of the batched writer.

Two routes carry their credential in the body, and are let through under the ordinary body
limit (`PHALANX_MAX_BODY_BYTES`, 413 before the body when the length says more): device
registration (the enrollment token) and the /ui login form (the token a browser pastes once).
"""

from __future__ import annotations

import json
from typing import Any

from api.auth import Authenticator, parse_bearer
from api.deps import principal_for
from api.error_responses import error_response

# routes that authenticate with something in their body, not a bearer token
CREDENTIAL_IN_BODY = frozenset({"/v1/devices/register", "/ui/login"})


def announces_body(headers: list[tuple[bytes, bytes]]) -> bool:
    for name, value in headers:
        if name == b"content-length":
            return value.strip() != b"0"
        if name == b"transfer-encoding":
            return True
    return False


class AuthBeforeBody:
    def __init__(self, app: Any, authenticator: Authenticator,
                 exempt: frozenset[str] = CREDENTIAL_IN_BODY) -> None:
        self.app, self.authenticator, self.exempt = app, authenticator, exempt

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (scope["type"] != "http" or scope["path"] in self.exempt
                or not announces_body(scope["headers"])):
            await self.app(scope, receive, send)
            return
        authorization = next((value.decode("latin-1") for name, value in scope["headers"]
                              if name == b"authorization"), None)
        try:
            if not self.authenticator.vouched(parse_bearer(authorization)):
                await principal_for(self.authenticator, authorization)
        except Exception as exc:  # 401, or 503 while the database cannot say
            mapped = error_response(exc)
            if mapped is None:
                raise
            await _refuse(send, *mapped)
            return
        await self.app(scope, receive, send)


async def _refuse(send: Any, status: int, detail: Any, extra: dict[str, str]) -> None:
    """The route's own answer (status and detail), sent before the body was read; the
    connection closes after it (the unread body is not waited for)."""
    body = json.dumps({"detail": detail}).encode()
    await send({"type": "http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
        *((name.lower().encode(), value.encode()) for name, value in extra.items())]})
    await send({"type": "http.response.body", "body": body})
