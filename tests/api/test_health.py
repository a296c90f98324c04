"""Liveness, readiness (database and Redis), and the OpenAPI docs."""

from __future__ import annotations

import re

from fastapi.testclient import TestClient

from roots.api import create_app
from tests.api.conftest import make_settings


def test_healthz_readyz_and_docs(api):
    healthz = api.client.get("/healthz")
    assert healthz.status_code == 200 and healthz.json() == {"status": "ok"}
    readyz = api.client.get("/readyz")
    assert readyz.status_code == 200 and readyz.json() == {"status": "ready"}
    assert api.client.get("/docs").status_code == 200
    paths = api.client.get("/openapi.json").json()["paths"]
    assert "/v1/devices/{device_id}/heartbeat" in paths and "/v1/jobs" in paths


def test_readyz_is_503_naming_what_is_down(sqlite_url, tmp_path):
    settings = make_settings(sqlite_url, tmp_path / "d", redis_url="redis://127.0.0.1:1/0")
    app = create_app(settings)
    with TestClient(app) as client:
        resp = client.get("/readyz")
    # docs/api.md: 503 {"detail": "...", "checks": {part: why}}, naming what is down only
    body = resp.json()
    assert resp.status_code == 503 and set(body) == {"detail", "checks"}
    assert body["checks"]["redis"] == "redis unreachable (ConnectionError)"
    assert "database" not in body["checks"]
    assert body["detail"] == "; ".join(body["checks"].values())
    app.state.engine.dispose()


def test_readyz_with_redis_configured(sqlite_url, redis_url, tmp_path):
    app = create_app(make_settings(sqlite_url, tmp_path / "d", redis_url=redis_url))
    with TestClient(app) as client:
        ready = client.get("/readyz")
        assert ready.status_code == 200 and ready.json() == {"status": "ready"}
    app.state.engine.dispose()


def test_unknown_paths_and_methods_answer_json(api):
    assert api.client.get("/v1/nothing").json() == {"detail": "Not Found"}
    assert api.client.put("/v1/jobs").status_code == 405


def test_the_docs_pages_work_offline_and_the_api_reads_as_a_clickable_contract(api):
    """/docs and /redoc load their scripts from this server (a lab may have no internet);
    the document declares the bearer token (an Authorize button), names operations as a
    client generator would, and gives every operation its error answers with one schema."""
    for page in ("/docs", "/redoc"):
        html = api.client.get(page).text
        assets = re.findall(r'(?:src|href)="([^"]+\.(?:js|css))"', html)
        assert assets and all(a.startswith("/static-offline-docs/") for a in assets), assets
        for asset in assets:
            served = api.client.get(asset)
            assert served.status_code == 200 and len(served.content) > 1000, asset
    doc = api.client.get("/openapi.json").json()
    assert doc["components"]["securitySchemes"]["bearer"] == {
        "type": "http", "scheme": "bearer", "description": doc["components"]["securitySchemes"]
        ["bearer"]["description"]}
    operations = {op["operationId"]: (path, method, op) for path, ops in doc["paths"].items()
                  for method, op in ops.items()}
    assert {"listDevices", "submitJob", "cancelJob", "sendHeartbeat", "uploadGradients"} <= set(
        operations)
    public = {"healthz", "readyz", "getInstallScript", "getAgentArchive", "registerDevice"}
    for name, (path, _method, op) in operations.items():
        answers = op["responses"]
        if name not in public:
            assert op.get("security") == [{"bearer": []}], name
            assert {"401", "403"} <= set(answers), name
        if "{" in path:
            assert "404" in answers, name
        if "requestBody" in op:
            assert {"413", "422"} <= set(answers), name
        for code, answer in answers.items():
            if code.startswith(("4", "5")):
                schema = answer["content"]["application/json"]["schema"]
                assert schema == {"$ref": "#/components/schemas/ErrorOut"}, (name, code)
    assert "409" in operations["cancelJob"][2]["responses"]
