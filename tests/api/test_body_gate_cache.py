"""The auth-before-body gate does not look a token up again while it was found valid lately:
a phone heartbeating every 10 s (past the 5 s token cache) costs no database lookup there ahead
of the batched writer, which checks the token itself; a stranger still costs one lookup and
gets 401 before any of its body is read."""

from __future__ import annotations

import asyncio

import pytest

from api import auth as auth_module
from api.auth import Principal, TokenCache, hash_token
from api.body_auth import AuthBeforeBody
from domain.errors import Unauthorized


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Tokens:
    """An Authenticator's interface over a TokenCache, counting its database lookups."""

    def __init__(self, cache: TokenCache, valid: set[str]) -> None:
        self.cache, self.valid, self.lookups = cache, {hash_token(v) for v in valid}, 0

    def cached(self, secret: str):
        token_hash = hash_token(secret)
        return token_hash, self.cache.get(token_hash)

    vouched = auth_module.Authenticator.vouched

    def lookup(self, token_hash: str) -> Principal:
        self.lookups += 1
        if token_hash not in self.valid:
            raise Unauthorized("invalid bearer token")
        principal = Principal(kind="device", token_id="t", device_id="d", name="phone")
        self.cache.put(token_hash, principal)
        return principal


def call(gate: AuthBeforeBody, token: str) -> int:
    sent: list[dict] = []
    reached: list[bool] = []

    async def app(scope, receive, send):
        reached.append(True)
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def send(message):
        sent.append(message)

    gate.app = app
    scope = {"type": "http", "path": "/v1/devices/d/heartbeat",
             "headers": [(b"content-length", b"100"), (b"authorization", f"Bearer {token}".encode())]}
    asyncio.run(gate(scope, None, send))
    return sent[0]["status"] if not reached else 200


def test_a_token_found_valid_lately_is_not_looked_up_again_by_the_gate(monkeypatch) -> None:
    clock = Clock()
    monkeypatch.setattr(auth_module.time, "monotonic", clock)
    tokens = Tokens(TokenCache(), {"phone-token"})
    gate = AuthBeforeBody(None, tokens)
    assert call(gate, "phone-token") == 200 and tokens.lookups == 1
    clock.now += 10.0  # the next heartbeat: past the 5 s cache, within the vouched time
    assert tokens.cache.get(hash_token("phone-token")) is None
    assert call(gate, "phone-token") == 200 and tokens.lookups == 1
    clock.now += auth_module.VOUCHED_TTL_S  # long silent: looked up again
    assert call(gate, "phone-token") == 200 and tokens.lookups == 2
    assert call(gate, "stranger") == 401 and tokens.lookups == 3
    tokens.cache.forget(token_id="t")  # revoked on this process: vouches for nothing
    assert not tokens.cache.vouched(hash_token("phone-token"))


@pytest.mark.parametrize("header", [None, "Basic x"])
def test_no_bearer_token_is_401_from_the_gate(header) -> None:
    tokens = Tokens(TokenCache(), set())
    gate = AuthBeforeBody(None, tokens)
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    headers = [(b"content-length", b"100")] + ([(b"authorization", header.encode())] if header else [])
    asyncio.run(gate({"type": "http", "path": "/v1/jobs", "headers": headers}, None, send))
    assert sent[0]["status"] == 401 and tokens.lookups == 0
