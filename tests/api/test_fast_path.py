"""The ASGI fast path (heartbeat and work long poll) answers exactly as the FastAPI routes it
stands in front of: same bodies, statuses and details for every kind of request, on Postgres
and SQLite. (An answer with an assignment: tests/scheduler/test_protocol.py.)"""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from api.fast_path import FastPath
from domain.store.models import TelemetrySample
from roots.api import create_app
from tests.api.conftest import Api, FakeClock, make_settings, sample


def _chain(app: Any) -> list[type]:
    layers, layer = [], app.middleware_stack
    while layer is not None and len(layers) < 50:
        layers.append(type(layer))
        layer = getattr(layer, "app", None)
    return layers


@pytest.fixture
def both(db_url: str, tmp_path: Path):
    """Two control planes on one database and one clock: `fast` as shipped, `router` with
    the fast path taken out (Starlette's own middleware stack)."""
    clock = FakeClock()
    settings = make_settings(db_url, tmp_path / "data")
    fast_app = create_app(settings, clock=clock)
    router_app = create_app(settings, clock=clock)
    router_app.build_middleware_stack = types.MethodType(FastAPI.build_middleware_stack,
                                                         router_app)
    with TestClient(fast_app) as fast, TestClient(router_app) as router:
        yield Api(fast, fast_app, clock, settings), Api(router, router_app, clock, settings)
    for app in (fast_app, router_app):
        app.state.engine.dispose()


def test_the_fast_path_is_in_front_and_the_route_is_documented(both):
    fast, router = both
    fast.get("/healthz")
    router.get("/healthz")
    assert FastPath in _chain(fast.app)
    assert FastPath not in _chain(router.app)
    paths = fast.get("/openapi.json").json()["paths"]
    assert "post" in paths["/v1/devices/{device_id}/heartbeat"]
    assert "get" in paths["/v1/devices/{device_id}/work"]
    from api.fast_path import ROUTES

    assert {(r.method, r.path) for r in ROUTES} == {
        ("POST", "/v1/devices/{device_id}/heartbeat"), ("GET", "/v1/devices/{device_id}/work")}


def _cases(api: Api, device: dict, other: dict) -> dict[str, Any]:
    """name -> (device id in the path, headers, body bytes or chunks)."""
    good = {"telemetry": [sample(1000.0), sample(1001.0, battery_pct=55.5)],
            "agent_version": "0.1.0"}
    mine = {"Authorization": f"Bearer {device['device_token']}",
            "content-type": "application/json"}
    raw = json.dumps(good).encode()
    huge = b'{"telemetry": [], "agent_version": "' + b"x" * (2 * 1024 * 1024) + b'"}'
    return {
        "accepted": (device["device_id"], mine, raw),
        "no token": (device["device_id"], {"content-type": "application/json"}, raw),
        "not bearer": (device["device_id"], {**mine, "Authorization": "Basic abc"}, raw),
        "unknown token": (device["device_id"], {**mine, "Authorization": "Bearer nope"}, raw),
        "admin token": (device["device_id"], {**mine, "Authorization": api.headers()[
            "Authorization"]}, raw),
        "another device's id": (other["device_id"], mine, raw),
        "unknown device id": ("dev-missing", mine, raw),
        "malformed JSON": (device["device_id"], mine, b'{"telemetry": ['),
        "unknown field": (device["device_id"], mine, b'{"telemetry": [], "colour": 1}'),
        "out of range": (device["device_id"], mine,
                         json.dumps({"telemetry": [sample(1.0, battery_pct=400)]}).encode()),
        "too large": (device["device_id"], mine, huge),
        "too large, chunked": (device["device_id"], mine, [huge[:600_000], huge[600_000:]]),
    }


EXPECTED = {"accepted": 200, "no token": 401, "not bearer": 401, "unknown token": 401,
            "admin token": 403, "another device's id": 403, "unknown device id": 403,
            "malformed JSON": 422, "unknown field": 422, "out of range": 422, "too large": 413,
            "too large, chunked": 413}


def test_every_answer_matches_the_route(both):
    fast, router = both
    device, other = fast.register("a"), fast.register("b")
    seen = {}
    for name, (device_id, headers, body) in _cases(fast, device, other).items():
        answers = []
        for api in (fast, router):
            content = iter(body) if isinstance(body, list) else body
            resp = api.client.post(f"/v1/devices/{device_id}/heartbeat", headers=headers,
                                   content=content)
            answers.append((resp.status_code, resp.headers["content-type"], resp.json()))
        assert answers[0] == answers[1], name
        seen[name] = answers[0][0]
        if answers[0][0] != 200:
            assert answers[0][2]["detail"], name  # every refusal names its problem
    assert seen == EXPECTED
    # the accepted heartbeat was stored once per app; nothing refused was stored
    assert fast.count(TelemetrySample) == 4


def test_fast_path_requests_are_counted_under_the_route_template(both):
    fast, _ = both
    device = fast.register()
    assert fast.heartbeat(device, {"telemetry": [sample(5.0)]}).status_code == 200
    assert fast.heartbeat(device, {"telemetry": "no"}).status_code == 422
    text = fast.client.get("/metrics").text
    line = [row for row in text.splitlines() if row.startswith("phalanx_http_requests_total")
            and "/v1/devices/{device_id}/heartbeat" in row]
    assert any('status="200"' in row for row in line), line
    assert any('status="422"' in row for row in line), line
    assert device["device_id"] not in text


WORK_EXPECTED = {"nothing to do": 200, "nothing after a wait": 200, "no token": 401,
                 "not bearer": 401, "unknown token": 401, "admin token": 403,
                 "another device's id": 403, "negative wait": 422, "wait too long": 422,
                 "wait not a number": 422, "bad token and bad wait": 401}


def test_every_work_answer_matches_the_route(both):
    fast, router = both
    device, other = fast.register("a"), fast.register("b")
    mine = {"Authorization": f"Bearer {device['device_token']}"}
    me = device["device_id"]
    cases = {
        "nothing to do": (me, mine, "wait=0"),
        "nothing after a wait": (me, mine, "wait=0.05"),
        "no token": (me, {}, "wait=0"),
        "not bearer": (me, {"Authorization": "Basic abc"}, "wait=0"),
        "unknown token": (me, {"Authorization": "Bearer nope"}, "wait=0"),
        "admin token": (me, fast.headers(), "wait=0"),
        "another device's id": (other["device_id"], mine, "wait=0"),
        "negative wait": (me, mine, "wait=-1"),
        "wait too long": (me, mine, "wait=31"),
        "wait not a number": (me, mine, "wait=soon"),
        "bad token and bad wait": (me, {"Authorization": "Bearer nope"}, "wait=-1"),
    }
    seen = {}
    for name, (device_id, headers, query) in cases.items():
        answers = []
        for api in (fast, router):
            resp = api.client.get(f"/v1/devices/{device_id}/work?{query}", headers=headers)
            answers.append((resp.status_code, resp.headers["content-type"], resp.json()))
        assert answers[0] == answers[1], name
        seen[name] = answers[0][0]
        if answers[0][0] != 200:
            assert answers[0][2]["detail"], name
        else:
            assert answers[0][2] == {"assignment": None}, name
    assert seen == WORK_EXPECTED
