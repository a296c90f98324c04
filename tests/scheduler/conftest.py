"""Fixtures the scheduler's tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from hotstate.blobs import BlobStore, MemoryBlobStore, RedisBlobStore


@pytest.fixture(params=["memory", "redis"])
def store(request: pytest.FixtureRequest) -> Iterator[BlobStore]:
    """Each hot-state store: in memory, and real Redis (the test process's own database)."""
    if request.param == "memory":
        yield MemoryBlobStore()
    else:
        yield RedisBlobStore(request.getfixturevalue("redis_url"))
