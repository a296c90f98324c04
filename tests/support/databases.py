"""Real databases for tests: a migrated Postgres template cloned per test, SQLite files, Redis."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from domain.store.db import libpq_url, upgrade

DEFAULT_PG_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/test"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/15"
HOW_TO_GET_SERVICES = (
    "run the suite through ./scripts/test (it starts private Postgres/Redis when none answer), "
    "or set PHALANX_TEST_DATABASE_URL / PHALANX_TEST_REDIS_URL"
)


def redis_test_url() -> str:
    """The Redis database this test process owns: PHALANX_TEST_REDIS_URL's number, minus the
    pytest-xdist worker's index (gw0 keeps it, gw1 takes the one below), so parallel workers never
    flush each other's keys."""
    base, _, number = os.environ.get("PHALANX_TEST_REDIS_URL", DEFAULT_REDIS_URL).rpartition("/")
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    return f"{base}/{(int(number or 0) - int(worker or 0)) % 16}"


def _with_database(url: str, name: str) -> str:
    base, _, _ = url.rpartition("/")
    return f"{base}/{name}"


class PostgresTemplate:
    """Migrates one template database per session; each test gets a cheap clone of it."""

    def __init__(self, admin_url: str) -> None:
        self.admin_url = admin_url
        self.name = f"phalanx_tmpl_{uuid.uuid4().hex[:8]}"

    def _execute(self, sql: str) -> None:
        import psycopg

        try:
            with psycopg.connect(libpq_url(self.admin_url), autocommit=True, connect_timeout=5) as conn:
                conn.execute(sql)
        except psycopg.OperationalError as exc:
            pytest.fail(f"cannot reach Postgres at {self.admin_url}: {exc}\n{HOW_TO_GET_SERVICES}")

    def create(self) -> None:
        self._execute(f'CREATE DATABASE "{self.name}"')
        upgrade(_with_database(self.admin_url, self.name))

    def clone(self) -> str:
        name = f"phalanx_t_{uuid.uuid4().hex[:10]}"
        self._execute(f'CREATE DATABASE "{name}" TEMPLATE "{self.name}"')
        return _with_database(self.admin_url, name)

    def drop_clone(self, url: str) -> None:
        self._execute(f'DROP DATABASE IF EXISTS "{url.rpartition("/")[2]}" WITH (FORCE)')

    def drop(self) -> None:
        self._execute(f'DROP DATABASE IF EXISTS "{self.name}" WITH (FORCE)')


def migrated_sqlite(path: Path) -> str:
    url = f"sqlite:///{path}"
    upgrade(url)
    return url


@contextmanager
def flushed_redis(url: str) -> Iterator[None]:
    import redis

    client = redis.Redis.from_url(url, socket_connect_timeout=5)
    try:
        client.flushdb()
    except redis.ConnectionError as exc:
        pytest.fail(f"cannot reach Redis at {url}: {exc}\n{HOW_TO_GET_SERVICES}")
    try:
        yield
    finally:
        client.flushdb()
        client.close()
