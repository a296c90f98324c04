"""Bearer tokens of three kinds (admin, user, device), stored as SHA-256 hashes only.

Every request hashes the presented secret and looks the hash up; the final equality is checked
with `hmac.compare_digest`. Lookups go through a small in-memory cache with a short TTL so the
hot heartbeat path costs no database round trip, while a revoked token stops working within
`TOKEN_CACHE_TTL_S` on every process (and at once on the process that revoked it).
"""

from __future__ import annotations

import datetime as dt
import hmac
import os
import threading
import time
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from domain.errors import Unauthorized
from domain.store.models import ApiToken, utcnow
from domain.store.tokens import Principal, hash_token, new_secret

TOKEN_CACHE_TTL_S = 5.0
TOKEN_CACHE_MAX = 100_000
# How long a token found valid lets its requests' bodies be read (api.body_auth) without
# another lookup: longer than any heartbeat interval, so a phone's heartbeats are not each a
# database lookup ahead of the batched writer, which checks the token again in its own
# transaction (as every route does); revoking forgets it at once on the revoking process
VOUCHED_TTL_S = 300.0


class TokenCache:
    """hash -> (Principal, deadline, vouched until). Misses are not cached: a new token works
    at once."""

    def __init__(self, ttl_s: float = TOKEN_CACHE_TTL_S,
                 vouched_ttl_s: float = VOUCHED_TTL_S) -> None:
        self.ttl_s, self.vouched_ttl_s = ttl_s, vouched_ttl_s
        self._entries: dict[str, tuple[Principal, float, float]] = {}
        self._lock = threading.Lock()

    def get(self, token_hash: str) -> Principal | None:
        entry = self._entries.get(token_hash)
        if entry is None or entry[1] < time.monotonic():
            return None
        return entry[0]

    def vouched(self, token_hash: str) -> bool:
        """Whether this token was found valid within the last `vouched_ttl_s`."""
        entry = self._entries.get(token_hash)
        return entry is not None and entry[2] >= time.monotonic()

    def put(self, token_hash: str, principal: Principal) -> None:
        now = time.monotonic()
        with self._lock:
            if len(self._entries) >= TOKEN_CACHE_MAX:
                self._entries.clear()
            self._entries[token_hash] = (principal, now + self.ttl_s, now + self.vouched_ttl_s)

    def forget(self, *, token_id: str | None = None, device_id: str | None = None) -> None:
        with self._lock:
            for key, (principal, *_) in list(self._entries.items()):
                if (token_id and principal.token_id == token_id) or (
                    device_id and principal.device_id == device_id
                ):
                    del self._entries[key]


class Authenticator:
    """Resolves a bearer secret to a Principal; the env admin token is compared in memory."""

    def __init__(self, factory: sessionmaker[Session], admin_token: str | None,
                 clock=utcnow, cache: TokenCache | None = None) -> None:
        self.factory = factory
        self.clock = clock
        self.cache = cache or TokenCache()
        self._admin_hash = hash_token(admin_token) if admin_token else None

    def cached(self, secret: str) -> tuple[str, Principal | None]:
        token_hash = hash_token(secret)
        if self._admin_hash and hmac.compare_digest(token_hash, self._admin_hash):
            return token_hash, Principal(kind="admin", name="env")
        return token_hash, self.cache.get(token_hash)

    def vouched(self, secret: str) -> bool:
        """Whether `secret` is the admin token or a token found valid lately (TokenCache):
        enough to read a request's body, not to act (the route checks the token itself)."""
        token_hash, principal = self.cached(secret)
        return principal is not None or self.cache.vouched(token_hash)

    def lookup(self, token_hash: str) -> Principal:
        """The database path (blocking): used on a cache miss."""
        with self.factory() as session:
            row = session.scalars(select(ApiToken).where(ApiToken.token_hash == token_hash)).first()
        if row is None or not hmac.compare_digest(row.token_hash, token_hash):
            raise Unauthorized("invalid bearer token")
        if row.revoked:
            raise Unauthorized("bearer token revoked")
        if row.expires_at is not None and row.expires_at <= self.clock():
            raise Unauthorized("bearer token expired")
        principal = Principal(kind=row.kind, token_id=row.id, device_id=row.device_id, name=row.name)
        self.cache.put(token_hash, principal)
        return principal


def parse_bearer(header: str | None) -> str:
    if not header:
        raise Unauthorized("missing bearer token (Authorization: Bearer <token>)")
    scheme, _, secret = header.partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise Unauthorized("malformed Authorization header; expected 'Bearer <token>'")
    return secret.strip()


def ensure_admin_token(factory: sessionmaker[Session], token_file: Path,
                       echo=print) -> str | None:
    """When no admin token is configured: create one once, write it to `token_file` (mode
    0600: not to stdout, which ends up in container logs) and keep only its hash.

    Returns the new secret, or None when an admin token already exists.
    """
    with factory() as session, session.begin():
        exists = session.scalars(
            select(ApiToken.id).where(ApiToken.kind == "admin", ApiToken.revoked.is_(False))
        ).first()
        if exists:
            return None
        secret = new_secret("admin")
        # the file first: if it cannot be written, nothing is committed and the next start
        # tries again (a hash stored for a secret nobody has would lock the admin out)
        write_private(token_file, secret + "\n")
        session.add(ApiToken(kind="admin", name="generated", token_hash=hash_token(secret)))
    echo(f"phalanx: generated an admin token, written to {token_file} (readable by this user "
         "only; the server keeps only its hash): read it, keep it, then delete the file")
    return secret


def write_private(path: Path, text: str) -> None:
    """`text` in a file only its owner can read, created that way (never world-readable, not
    even for a moment) and replaced atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.unlink(missing_ok=True)  # O_EXCL below: never a stale file's mode
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.replace(tmp, path)


def expires_in(clock, seconds: float | None) -> dt.datetime | None:
    return None if seconds is None else clock() + dt.timedelta(seconds=seconds)
