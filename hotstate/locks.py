"""A leased lock in the blob store: one placement pass at a time across every worker.

The lease expires, so a holder killed mid-pass frees it within `ttl`; losing Redis frees it too
(the next pass simply takes it).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from hotstate.blobs import BlobStore


def acquire(blobs: BlobStore, key: str, ttl: float) -> str | None:
    token = uuid.uuid4().hex
    return token if blobs.set_if_absent(key, token.encode(), ttl=ttl) else None


def release(blobs: BlobStore, key: str, token: str) -> None:
    if blobs.get(key) == token.encode():
        blobs.delete(key)


@contextmanager
def held(blobs: BlobStore, key: str, ttl: float) -> Iterator[str | None]:
    """Yields the token, or None when someone else holds the lock (the caller skips its work)."""
    token = acquire(blobs, key, ttl)
    try:
        yield token
    finally:
        if token is not None:
            release(blobs, key, token)
