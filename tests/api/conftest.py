"""An in-process control plane per test (TestClient) on the `db_url` database, with a clock the
test moves by hand, and factories for the tokens and devices most tests start from."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import func, select

from domain.settings import Settings
from domain.store.models import utcnow
from roots.api import create_app
from tests.support.env import ADMIN_TOKEN as ADMIN


class FakeClock:
    def __init__(self) -> None:
        self.now = utcnow()

    def __call__(self) -> dt.datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += dt.timedelta(seconds=seconds)


@dataclass
class Api:
    client: TestClient
    app: Any
    clock: FakeClock
    settings: Settings

    def headers(self, token: str = ADMIN) -> dict[str, str]:
        return {"Authorization": f"Bearer {token}"}

    def get(self, path: str, token: str = ADMIN, **kw: Any):
        return self.client.get(path, headers=self.headers(token), **kw)

    def post(self, path: str, token: str = ADMIN, **kw: Any):
        return self.client.post(path, headers=self.headers(token), **kw)

    def delete(self, path: str, token: str = ADMIN, **kw: Any):
        return self.client.delete(path, headers=self.headers(token), **kw)

    def count(self, model: Any) -> int:
        with self.app.state.session_factory() as session:
            return session.scalar(select(func.count()).select_from(model))

    def enrollment_token(self, **body: Any) -> str:
        resp = self.post("/v1/enrollment-tokens", json=body)
        assert resp.status_code == 201, resp.text
        return resp.json()["token"]

    def register(self, name: str = "phone", labels: dict[str, str] | None = None,
                 token: str | None = None, **spec: Any) -> dict[str, Any]:
        body = {"enrollment_token": token or self.enrollment_token(), "name": name,
                "labels": labels or {},
                "spec": {"model": "SM-G975F", "cpu_cores": 8, **spec}}
        resp = self.client.post("/v1/devices/register", json=body)
        assert resp.status_code == 201, resp.text
        return resp.json()

    def user_token(self, name: str = "alice") -> str:
        resp = self.post("/v1/tokens", json={"name": name})
        assert resp.status_code == 201, resp.text
        return resp.json()["token"]

    def heartbeat(self, device: dict[str, Any], body: dict[str, Any] | None = None):
        return self.post(f"/v1/devices/{device['device_id']}/heartbeat",
                         token=device["device_token"], json={"telemetry": []} if body is None else body)


def make_settings(db_url: str, data_dir: Path, **overrides: Any) -> Settings:
    return Settings(database_url=db_url, data_dir=data_dir, admin_token=ADMIN, **overrides)


@contextmanager
def api_on(db_url: str, tmp_path: Path) -> Iterator[Api]:
    """A started control plane (lifespan run) on `db_url` with a hand-moved clock."""
    clock = FakeClock()
    settings = make_settings(db_url, tmp_path / "data")
    app = create_app(settings, clock=clock)
    with TestClient(app) as client:
        yield Api(client, app, clock, settings)
    app.state.engine.dispose()


@pytest.fixture
def api(db_url: str, tmp_path: Path) -> Iterator[Api]:
    with api_on(db_url, tmp_path) as started:
        yield started


def sample(ts: float, **values: Any) -> dict[str, Any]:
    return {"ts": ts, "battery_pct": 80.0, "charging": False, "cpu_temp_c": 40.0, **values}
