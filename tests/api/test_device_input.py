"""What a phone sends in its heartbeat is typed and bounded before anything reads it (issue 42,
items 1 and 2): `capabilities` (archs, backends, features: lists of at most 64 names of 1-64
printable characters; compute_class as before; keys a later agent adds dropped) and `profiles`
(at most 64 archs, each a finite speed in (0, 1e8] and its execution choice). A refused
heartbeat is a 422 naming the field and changes nothing; what the rows hold from before (any
JSON: written before the schema said so) breaks no one's dry run, submit or placement."""

from __future__ import annotations

import json
from typing import Any

import pytest
from sqlalchemy import select, update
from sqlalchemy.exc import DBAPIError

from agent.runtime.agent import FEATURES
from api.schemas.devices import MAX_SAMPLES_PER_S
from domain.store.models import Device, DeviceLog, Job, ShardAssignment
from scheduler import context
from scheduler.policy.types import MAX_SPEED
from scheduler.tasks.reconcile import run_reconcile
from tests.api.conftest import sample

SPEC = {"name": "typed", "model": {"arch": "mlp", "hidden": 8},
        "dataset": "synthetic:1x4x4:3:64", "global_batch_size": 16, "shards": 8, "epochs": 1,
        "exactness": "portable", "placement": {"min_devices": 1, "max_devices": 8}}
HONEST = 1e5  # samples/s: above the estimate for a phone not yet measured (mlp: 4000 a core)
CAPS = {"features": list(FEATURES), "archs": ["logreg", "mlp", "cnn", "custom"],
        "backends": ["numpy"]}


def raw_heartbeat(api, device: dict[str, Any], body: str):
    """A body as an attacker writes it: NaN and Infinity are JSON tokens to Python's parser."""
    return api.client.post(f"/v1/devices/{device['device_id']}/heartbeat", content=body,
                           headers={**api.headers(device["device_token"]),
                                    "Content-Type": "application/json"})


def locs(resp) -> list[tuple[str, ...]]:
    assert resp.status_code == 422, resp.text
    return [tuple(str(part) for part in err["loc"]) for err in resp.json()["detail"]]


def loc(*parts: Any) -> tuple[str, ...]:
    return tuple(str(part) for part in parts)


def plans_and_places(api) -> str:
    """A user's dry run and submit answer, and placement places the job: its id."""
    user = api.user_token("planner")
    dry = api.post("/v1/jobs?dry_run=true", token=user, json=SPEC)
    assert dry.status_code == 200, dry.text
    made = api.post("/v1/jobs", token=user, json=SPEC)
    assert made.status_code == 201, made.text
    run_reconcile(context.get_context())
    job = api.get(f"/v1/jobs/{made.json()['id']}").json()
    assert job["state"] == "Running", job
    return job["id"]


def shares(api, job_id: str) -> dict[str, int]:
    with api.app.state.session_factory() as s:
        rows = s.scalars(select(ShardAssignment.device_id).where(
            ShardAssignment.job_id == job_id, ShardAssignment.role == "primary")).all()
    return {d: rows.count(d) for d in set(rows)}


def test_the_issues_capabilities_are_a_422_naming_each_field_and_every_plan_goes_on(api):
    phone = api.register("hostile")
    resp = api.heartbeat(phone, {"telemetry": [], "capabilities": {
        "archs": [["x"]], "backends": [[1]], "features": 5}})
    assert set(locs(resp)) == {loc("body", "capabilities", "archs", 0),
                               loc("body", "capabilities", "backends", 0),
                               loc("body", "capabilities", "features")}
    assert api.get(f"/v1/devices/{phone['device_id']}").json()["lease_renewed_at"] is not None
    assert api.heartbeat(phone, {"telemetry": [], "capabilities": CAPS}).status_code == 200
    plans_and_places(api)


@pytest.mark.parametrize("caps, where", [
    ({"archs": "cnn"}, ("archs",)),  # a name where a list goes
    ({"archs": ["a b"]}, ("archs", 0)),  # a space
    ({"archs": ["cnn\n"]}, ("archs", 0)),  # a newline past a `$`
    ({"archs": ["é"]}, ("archs", 0)),
    ({"archs": [""]}, ("archs", 0)),
    ({"backends": ["x" * 65]}, ("backends", 0)),
    ({"features": ["portable"] * 65}, ("features",)),  # at most 64 names
    ({"features": [1]}, ("features", 0)),
    ({"backends": {"numpy": True}}, ("backends",)),
])
def test_a_capability_that_is_not_a_short_list_of_names_is_a_422_naming_it(
        api, caps: dict[str, Any], where: tuple[Any, ...]) -> None:
    resp = api.heartbeat(api.register("p"), {"telemetry": [], "capabilities": caps})
    assert loc("body", "capabilities", *where) in locs(resp)


@pytest.mark.parametrize("speed", ["1e308", "Infinity", "-Infinity", "NaN", "0", "-5", "true",
                                   '"812"', "100000000.5", "1e400", "[1]"])
def test_a_speed_that_is_not_a_finite_number_in_range_is_a_422_naming_it(
        api, speed: str) -> None:
    phone = api.register("p")
    resp = raw_heartbeat(api, phone, '{"telemetry": [], "profiles": {"mlp": '
                                     f'{{"samples_per_s": {speed}}}}}}}')
    assert locs(resp) == [loc("body", "profiles", "mlp", "samples_per_s")]
    assert api.get(f"/v1/devices/{phone['device_id']}").json()["profiles"] == {}


@pytest.mark.parametrize("profiles, where", [
    ({"a b": {"samples_per_s": 1.0}}, ("a b", "[key]")),
    ({f"arch{i}": {"samples_per_s": 1.0} for i in range(65)}, ()),  # at most 64 archs
    ({"mlp": {"threads": 0}}, ("mlp", "threads")),
    ({"mlp": {"cores": [-1]}}, ("mlp", "cores", 0)),
    ({"mlp": {"cores": list(range(1025))}}, ("mlp", "cores")),
    ({"mlp": {"backend": ["numpy"]}}, ("mlp", "backend")),
    ({"mlp": {"pinned": "yes"}}, ("mlp", "pinned")),
    ({"mlp": 812.0}, ("mlp",)),
    ({"mlp": {"power_w": 1e9}}, ("mlp", "power_w")),
])
def test_a_profile_out_of_its_schema_is_a_422_naming_it(
        api, profiles: dict[str, Any], where: tuple[Any, ...]) -> None:
    resp = api.heartbeat(api.register("p"), {"telemetry": [], "profiles": profiles})
    assert loc("body", "profiles", *where) in locs(resp)


def test_typed_parts_are_stored_as_sent_and_keys_a_later_agent_adds_are_dropped(api) -> None:
    phone = api.register("newer")
    profile = {"samples_per_s": 812.0, "threads": 4, "cores": [4, 5, 6, 7],
               "backend": "numpy", "core_set": "big", "pinned": True, "power_w": 2.5}
    resp = api.heartbeat(phone, {"telemetry": [], "capabilities": {
        **CAPS, "archs": ["mlp", "?"], "gpu": {"vulkan": True}}, "profiles": {
        "mlp": {**profile, "npu": "later"}, "cnn": {"samples_per_s": MAX_SAMPLES_PER_S},
        "logreg": {"samples_per_s": 5e-324}, "custom": {}}})
    assert resp.status_code == 200, resp.text
    with api.app.state.session_factory() as s:
        row = s.get(Device, phone["device_id"])
        assert row.capabilities == {**CAPS, "archs": ["mlp", "?"]}
        assert row.profiles == {"mlp": profile, "cnn": {"samples_per_s": 1e8},
                                "logreg": {"samples_per_s": 5e-324}, "custom": {}}
    shown = api.get(f"/v1/devices/{phone['device_id']}").json()
    assert shown["capabilities"]["archs"] == ["mlp", "?"] and "gpu" not in shown["capabilities"]
    assert shown["profiles"]["mlp"] == profile
    assert shown["profiles"]["custom"]["samples_per_s"] is None
    assert MAX_SAMPLES_PER_S == MAX_SPEED  # the door's bound is the scheduler's


def test_the_speed_bound_is_taken_and_placed_by_speed_and_past_it_refused(api) -> None:
    """Two phones claiming the most a phone may (1e8 samples/s; the issue's 1e308 summed to
    infinity and failed the job with "cannot convert float NaN to integer"), one slow one."""
    for name, speed in (("fast-1", MAX_SAMPLES_PER_S), ("fast-2", MAX_SAMPLES_PER_S),
                        ("slow", 1e6)):
        phone = api.register(name)
        past = {"mlp": {"samples_per_s": MAX_SAMPLES_PER_S * (1 + 1e-15)}}
        assert api.heartbeat(phone, {"telemetry": [], "profiles": past}).status_code == 422
        assert api.heartbeat(phone, {"telemetry": [sample(api.clock.now.timestamp())],
                                     "capabilities": CAPS,
                                     "profiles": {"mlp": {"samples_per_s": speed}}}
                             ).status_code == 200
    job_id = plans_and_places(api)
    assert sorted(shares(api, job_id).values()) == [1, 3, 4]  # the slow phone: one shard


def store(api, device_id: str, **columns: Any) -> None:
    """Columns as a row written before the schemas said what they hold."""
    with api.app.state.session_factory.begin() as s:
        s.execute(update(Device).where(Device.id == device_id).values(**columns))


GARBAGE: list[dict[str, Any]] = [
    {"capabilities": {"archs": [["x"]], "backends": [[1]], "features": 5}},  # the issue's
    {"capabilities": {"archs": [{"a": 1}, "mlp"], "backends": "numpy", "features": {"x": 1},
                      "compute_class": [1]}},
    {"capabilities": [1, 2], "profiles": [3], "latest_telemetry": "hot", "spec": 7,
     "labels": ["rack"]},
    {"profiles": {"mlp": {"samples_per_s": 1e308}}},  # the issue's
    {"profiles": {"mlp": {"samples_per_s": 10**400}}},  # an int past any float
    {"latest_telemetry": {"battery_pct": [], "cpu_temp_c": "40", "battery_temp_c": 1e308,
                          "charging": "yes"},
     "spec": {"cpu_cores": 1e308, "ram_mb": -5}},
]
NOT_JSON = [  # no Postgres json holds these: rows SQLite's JSON may hold
    {"profiles": {"mlp": {"samples_per_s": float("inf")}},
     "latest_telemetry": {"cpu_temp_c": float("nan"), "battery_pct": float("-inf")},
     "spec": {"cpu_cores": float("nan"), "ram_mb": float("inf")}},
]


@pytest.mark.parametrize("columns", GARBAGE + NOT_JSON, ids=lambda c: json.dumps(c)[:60])
def test_rows_from_before_break_no_plan_and_win_no_placement(api, columns) -> None:
    if columns in NOT_JSON and api.settings.database_url.startswith("postgresql"):
        # no such row can exist there: Postgres' json refuses NaN and Infinity
        hostile = api.register("hostile")
        with pytest.raises(DBAPIError):
            store(api, hostile["device_id"], **columns)
        return
    for name in ("honest-1", "honest-2", "hostile"):
        phone = api.register(name)
        assert api.heartbeat(phone, {"telemetry": [sample(api.clock.now.timestamp())],
                                     "capabilities": CAPS,
                                     "profiles": {"mlp": {"samples_per_s": HONEST}}}
                             ).status_code == 200
    store(api, phone["device_id"], **columns)  # the last one's
    job_id = plans_and_places(api)
    held = shares(api, job_id)
    # what is malformed counts as absent: no more than an honest phone's share
    assert sum(held.values()) == 8 and held.get(phone["device_id"], 0) <= 3, held
    with api.app.state.session_factory.begin() as s:  # lines shipped before LogLine said
        s.add(DeviceLog(device_id=phone["device_id"], shipped_at=api.clock.now, lines=[
            {"seq": 2**64, "ts": 1.0, "level": "INFO", "message": "past a bigint"},
            {"seq": 1, "ts": 2.0, "level": "INFO\n", "message": "a forged line"},
            {"seq": 2, "ts": 3.0, "level": "INFO", "message": "fine"}, "not a line"]))
    for path in ("/v1/devices", f"/v1/devices/{phone['device_id']}", "/v1/agent/rollout",
                 "/metrics", "/ui", f"/v1/devices/{phone['device_id']}/logs"):
        assert api.get(path).status_code == 200, path
    lines = api.get(f"/v1/devices/{phone['device_id']}/logs").json()["lines"]
    assert [line["message"] for line in lines] == ["fine"]
    # the phone sends clean capabilities again: its next heartbeat replaces the row's parts
    assert api.heartbeat(phone, {"telemetry": [], "capabilities": CAPS,
                                 "profiles": {"mlp": {"samples_per_s": HONEST}}}
                         ).status_code == 200
    assert api.count(Job) == 1
