"""The end-to-end tests' cluster: Postgres, Redis, one `phalanx server` and one `phalanx worker`
as real processes (agents are started by each test)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.cluster import Cluster
from tests.support.env import ADMIN_TOKEN as ADMIN


@pytest.fixture
def cluster(tmp_path: Path, pg_url: str, redis_url: str) -> Iterator[Cluster]:
    c = Cluster(tmp_path, pg_url, ADMIN, redis_url=redis_url)
    try:
        c.start_server()
        c.start_worker()
        yield c
    finally:
        c.stop()
