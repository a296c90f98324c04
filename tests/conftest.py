"""Shared fixtures: real Postgres, SQLite and Redis, and a live `phalanx server` process.

Postgres and Redis come from PHALANX_TEST_DATABASE_URL / PHALANX_TEST_REDIS_URL, which
scripts/test sets (starting private servers when none answer). A test that needs one and cannot
reach it fails with a message that says how to get it: nothing is skipped silently.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.databases import (
    DEFAULT_PG_URL,
    PostgresTemplate,
    flushed_redis,
    migrated_sqlite,
    redis_test_url,
)
from tests.support.env import ADMIN_TOKEN
from tests.support.server import LiveServer, start_server


@pytest.fixture(scope="session")
def pg_template() -> Iterator[PostgresTemplate]:
    template = PostgresTemplate(os.environ.get("PHALANX_TEST_DATABASE_URL", DEFAULT_PG_URL))
    template.create()
    yield template
    template.drop()


@pytest.fixture
def pg_url(pg_template: PostgresTemplate) -> Iterator[str]:
    """A fresh, migrated Postgres database for this test only."""
    url = pg_template.clone()
    yield url
    pg_template.drop_clone(url)


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    """A fresh, migrated SQLite file for this test only."""
    return migrated_sqlite(tmp_path / f"phalanx-{uuid.uuid4().hex[:8]}.sqlite")


@pytest.fixture(params=["postgres", "sqlite"])
def db_url(request: pytest.FixtureRequest) -> str:
    """Run the test once on Postgres and once on SQLite."""
    name = "pg_url" if request.param == "postgres" else "sqlite_url"
    return request.getfixturevalue(name)


@pytest.fixture
def redis_url() -> Iterator[str]:
    """A private Redis database number, flushed before and after the test."""
    url = redis_test_url()
    with flushed_redis(url):
        yield url




@pytest.fixture
def admin_token() -> str:
    return ADMIN_TOKEN


@pytest.fixture
def live_server(sqlite_url: str, tmp_path: Path) -> Iterator[LiveServer]:
    """`phalanx server` in embedded mode (SQLite, in-process Celery) as a real subprocess."""
    server = start_server(database_url=sqlite_url, data_dir=tmp_path / "data", admin_token=ADMIN_TOKEN)
    yield server
    server.stop()
