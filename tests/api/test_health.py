"""Liveness, readiness (database and Redis), and the OpenAPI docs."""

from __future__ import annotations

from fastapi.testclient import TestClient

from api.main import create_app
from tests.api.conftest import make_settings


def test_healthz_readyz_and_docs(api):
    assert api.client.get("/healthz").json() == {"status": "ok"}
    assert api.client.get("/readyz").status_code == 200
    assert api.client.get("/docs").status_code == 200
    paths = api.client.get("/openapi.json").json()["paths"]
    assert "/v1/devices/{device_id}/heartbeat" in paths and "/v1/jobs" in paths


def test_readyz_is_503_naming_what_is_down(sqlite_url, tmp_path):
    settings = make_settings(sqlite_url, tmp_path / "d", redis_url="redis://127.0.0.1:1/0")
    app = create_app(settings)
    with TestClient(app) as client:
        resp = client.get("/readyz")
    assert resp.status_code == 503 and "redis" in resp.json()["detail"]
    app.state.engine.dispose()


def test_readyz_with_redis_configured(sqlite_url, redis_url, tmp_path):
    app = create_app(make_settings(sqlite_url, tmp_path / "d", redis_url=redis_url))
    with TestClient(app) as client:
        assert client.get("/readyz").status_code == 200
    app.state.engine.dispose()


def test_unknown_paths_and_methods_answer_json(api):
    assert api.client.get("/v1/nothing").json() == {"detail": "Not Found"}
    assert api.client.put("/v1/jobs").status_code == 405
