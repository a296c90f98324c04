"""Hypothesis over what a phone may send in a heartbeat (capabilities, profiles, telemetry,
pause, agent version), as the device itself, on both databases (issue 42: typed and bounded
input everywhere). Bodies are the schema's own at its edges (the largest speed, the longest
names, 64 archs, NaN where a number may be null...) or such a body with one part replaced by
any JSON at all, NaN and Infinity written as the tokens Python's parser takes. No answer is a
5xx, and no heartbeat that was accepted breaks a later request of anyone: after each, a user's
dry run and submit answer, the job is placed (never Failed by what the phone said) and
cancelled, and the device reads, the fleet list and /metrics answer."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.runtime.agent import FEATURES
from api.schemas.devices import MAX_NAMES, MAX_SAMPLES_PER_S
from roots.api import create_app
from scheduler import context
from scheduler.tasks.reconcile import run_reconcile, run_reconcile_job
from tests.api.conftest import Api, FakeClock, make_settings

EXAMPLES = 100  # per database: each accepted one costs a dry run, a placement and a cancel
SPEC = {"name": "fuzzed-fleet", "model": {"arch": "mlp", "hidden": 8},
        "dataset": "synthetic:1x4x4:3:64", "global_batch_size": 16, "shards": 8, "epochs": 1,
        "exactness": "portable", "placement": {"min_devices": 1, "max_devices": 8}}
FACTS = {"machine": "x86_64", "numpy": "2.4.6",
         "blas": {"library": "openblas", "version": "0.3.31", "kernel": "SkylakeX"},
         "simd": "X86_V4", "simd_features": 42, "fingerprint": "be23673d0b4b503b"}

# -- what a phone may send, at the schema's edges -------------------------------------------

NAME = st.sampled_from(["logreg", "mlp", "cnn", "custom", "numpy", "torch", "portable",
                        "self_upgrade", "?", "x" * 64]) | st.from_regex(
    r"[\x21-\x7e]{1,64}", fullmatch=True)
NAMES = st.lists(NAME, max_size=4) | st.lists(NAME, min_size=MAX_NAMES, max_size=MAX_NAMES)
SPEED = st.floats(min_value=0, max_value=MAX_SAMPLES_PER_S, exclude_min=True) | st.sampled_from(
    [MAX_SAMPLES_PER_S, 5e-324, 1.0])
PROFILE = st.fixed_dictionaries({}, optional={
    "samples_per_s": SPEED, "threads": st.integers(1, 1024),
    "cores": st.lists(st.integers(0, 4095), max_size=8), "backend": st.text(max_size=64),
    "core_set": st.text(max_size=64), "pinned": st.booleans(),
    "power_w": st.floats(-1000, 1000), "from_a_later_agent": st.integers()})
ARCHS = st.just(["logreg", "mlp", "cnn", "custom"])  # what today's agent says (and mlp)
TODAYS = st.just(list(FEATURES))  # a portable job needs `portable`
CAPABILITIES = st.fixed_dictionaries({"features": TODAYS | TODAYS | TODAYS | NAMES | st.none()},
                                     optional={
    "archs": ARCHS | ARCHS | NAMES | st.none(), "backends": NAMES | st.none(),
    "compute_class": st.just(FACTS) | st.none(), "from_a_later_agent": st.text()})


NOW = "now"  # the server's clock at the request: the device's latest sample moves on


def bounded(low: float, high: float) -> st.SearchStrategy[float | None]:
    return st.none() | st.floats(low, high) | st.sampled_from([low, high])


SAMPLE = st.fixed_dictionaries({"ts": st.just(NOW) | st.floats(0, 1.7e9) | st.sampled_from(
    ["2025-12-02T18:00:01Z", "1970-01-01T00:00:00", 0])}, optional={
    "battery_pct": bounded(0, 100), "charging": st.none() | st.booleans(),
    "battery_temp_c": bounded(-50, 200), "cpu_temp_c": bounded(-50, 200),
    "power_w": bounded(-1000, 1000), "cpu_freq_mhz": bounded(0, 100_000),
    "throttled": st.none() | st.booleans(), "busy": st.none() | st.booleans()})
COOL = st.just({"ts": NOW, "battery_pct": 90.0, "charging": True, "cpu_temp_c": 30.0})
BODY = st.fixed_dictionaries({"telemetry": st.lists(COOL | SAMPLE, max_size=3)}, optional={
    "agent_version": st.none() | st.text(max_size=40),
    "capabilities": st.none() | CAPABILITIES,
    "profiles": st.none() | st.dictionaries(NAME, PROFILE, max_size=3),
    "pause": st.none() | st.fixed_dictionaries(
        {"reason": st.text(min_size=1, max_size=40)},
        optional={"detail": st.none() | st.text(max_size=100)})})

# -- and anything at all in one place ---------------------------------------------------------

LEAF = (st.none() | st.booleans() | st.integers(-(2**80), 2**80)
        | st.floats(allow_nan=True, allow_infinity=True)
        | st.sampled_from([1e308, -1e308, math.nan, math.inf, 5e-324, MAX_SAMPLES_PER_S * 2])
        | st.text(max_size=8) | st.sampled_from(["mlp", "a b", "x\n", "é", "" , "NaN"]))
ANY_JSON = st.recursive(LEAF, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
    NAME | st.text(max_size=4), inner, max_size=3), max_leaves=10)
PLACES = [("capabilities",), ("capabilities", "archs"), ("capabilities", "archs", 0),
          ("capabilities", "backends"), ("capabilities", "features"),
          ("capabilities", "compute_class"), ("capabilities", "compute_class", "fingerprint"),
          ("profiles",), ("profiles", "mlp"), ("profiles", "mlp", "samples_per_s"),
          ("profiles", "mlp", "cores"), ("telemetry",), ("telemetry", 0),
          ("telemetry", 0, "ts"), ("telemetry", 0, "battery_pct"), ("telemetry", 0, "charging"),
          ("pause",), ("pause", "reason"), ("agent_version",), ("from_a_later_agent",)]


def dated(body: Any, now: float) -> Any:
    """The body with every NOW replaced by the server's clock."""
    if isinstance(body, dict):
        return {k: dated(v, now) for k, v in body.items()}
    if isinstance(body, list):
        return [dated(v, now) for v in body]
    return now if body == NOW else body


def put(body: dict[str, Any], place: tuple[Any, ...], value: Any) -> None:
    """body[place] = value, making the containers on the way."""
    node: Any = body
    for step, after in zip(place, place[1:]):
        if isinstance(node, list):
            while len(node) <= step:
                node.append({})
            if not isinstance(node[step], (dict, list)):
                node[step] = [] if isinstance(after, int) else {}
        elif not isinstance(node.get(step), (dict, list)):
            node[step] = [] if isinstance(after, int) else {}
        node = node[step]
    last = place[-1]
    if isinstance(node, list):
        while len(node) <= last:
            node.append(None)
    node[last] = value


@st.composite
def heartbeats(draw: st.DrawFn) -> dict[str, Any]:
    body = draw(BODY)
    if draw(st.booleans()):
        put(body, draw(st.sampled_from(PLACES)), draw(ANY_JSON))
    return body


# -- the fleet ------------------------------------------------------------------------------

@dataclass
class Fleet:
    """A control plane (no heartbeat rate limit), an honest phone, the fuzzed phone, a user."""

    api: Api
    honest: dict[str, Any]
    phone: dict[str, Any]
    user: str

    def tick(self) -> None:
        """A second on: the honest phone heartbeats (its lease stays fresh)."""
        self.api.clock.advance(1.0)  # the rate limit counts on the server's clock
        assert self.api.heartbeat(self.honest, {
            "telemetry": [{"ts": self.api.clock.now.timestamp(), "charging": True}],
            "capabilities": {"features": list(FEATURES)},
            "profiles": {"mlp": {"samples_per_s": 100.0}}}).status_code == 200

    def send(self, path: str, body: Any):
        """`body` as JSON (NaN and Infinity as the tokens) with the fuzzed phone's token."""
        text = json.dumps(dated(body, self.api.clock.now.timestamp()))
        return self.api.client.post(
            f"/v1/devices/{self.phone['device_id']}/{path}", content=text,
            headers={**self.api.headers(self.phone["device_token"]),
                     "Content-Type": "application/json"})


@pytest.fixture
def fleet(db_url: str, tmp_path: Path) -> Iterator[Fleet]:
    clock = FakeClock()
    settings_ = make_settings(db_url, tmp_path / "data", heartbeat_max_per_minute=1e9)
    app = create_app(settings_, clock=clock)
    with TestClient(app) as client:
        api = Api(client, app, clock, settings_)
        fuzzed = api.register("fuzzed")  # an agent of today, until the examples say otherwise
        assert api.heartbeat(fuzzed, {"telemetry": [], "capabilities": {
            "features": list(FEATURES)}}).status_code == 200
        yield Fleet(api, api.register("honest"), fuzzed, api.user_token("someone"))
    app.state.engine.dispose()


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(body=heartbeats())
def test_no_heartbeat_answers_a_5xx_or_breaks_a_later_request(
        fleet: Fleet, body: dict[str, Any]) -> None:
    api, phone, user = fleet.api, fleet.phone, fleet.user
    fleet.tick()
    resp = fleet.send("heartbeat", body)
    assert resp.status_code in (200, 422), resp.text
    if resp.status_code == 422:
        return
    dry = api.post("/v1/jobs?dry_run=true", token=user, json=SPEC)
    assert dry.status_code == 200, dry.text
    made = api.post("/v1/jobs", token=user, json=SPEC)
    assert made.status_code == 201, made.text
    run_reconcile(context.get_context())
    job = api.get(f"/v1/jobs/{made.json()['id']}", token=user).json()
    assert job["state"] == "Running", job  # on the honest phone at least: never Failed
    assert api.post(f"/v1/jobs/{job['id']}/cancel", token=user).status_code == 200
    run_reconcile_job(context.get_context(), job["id"])  # its phones released
    for path in (f"/v1/devices/{phone['device_id']}", "/v1/devices", "/metrics"):
        assert api.get(path).status_code == 200, path


LINE = st.fixed_dictionaries({
    "seq": st.integers(0, 2**40) | st.integers(0, 2**64),
    "ts": st.sampled_from([math.nan, math.inf, -math.inf, 1.7e9])
    | st.floats(allow_nan=True, allow_infinity=True),
    "level": st.sampled_from(["INFO", "WARNING"]) | st.text(max_size=10),
    "message": st.text(max_size=50)})


@settings(max_examples=EXAMPLES // 2, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(lines=st.lists(LINE | LINE | ANY_JSON, max_size=3))
def test_no_log_shipment_answers_a_5xx_or_breaks_reading_them(
        fleet: Fleet, lines: list[Any]) -> None:
    resp = fleet.send("logs", {"lines": lines})
    assert resp.status_code in (200, 422), resp.text
    read = fleet.api.get(f"/v1/devices/{fleet.phone['device_id']}/logs")
    assert read.status_code == 200, read.text
