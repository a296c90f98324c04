"""Filters and scores, table-driven: each row is a sentence about one phone."""

from __future__ import annotations

import pytest

from scheduler.policy.filters import (
    FILTERS,
    KEEP_FILTERS,
    UNRESOLVABLE,
    UNSCHEDULABLE,
    fits_no_phone,
    run_filters,
)
from scheduler.policy.scores import device_speed, score
from scheduler.policy.types import DeviceView, PlacementRequest

REQ = PlacementRequest(job_id="job-a", arch="cnn", shards=8, min_battery=20, max_temp_c=45,
                       selector={"rack": "a"}, memory_mb=1500)
BASE = DeviceView(id="dev-1", labels={"rack": "a"}, battery_pct=80, charging=False, temp_c=35,
                  compute_class="be23673d0b4b503b")

FILTER_CASES = {
    "a healthy phone in the right rack passes": (BASE, None),
    "a phone whose lease expired is not ready": (
        DeviceView(**{**BASE.__dict__, "state": "NotReady"}), UNSCHEDULABLE),
    "a cordoned phone needs a person": (
        DeviceView(**{**BASE.__dict__, "cordoned": True}), UNRESOLVABLE),
    "a draining phone needs a person": (
        DeviceView(**{**BASE.__dict__, "draining": True}), UNRESOLVABLE),
    "a phone paused for heat waits": (
        DeviceView(**{**BASE.__dict__, "pause_reason": "thermal"}), UNSCHEDULABLE),
    "a phone installing a new agent takes no job until it is back": (
        DeviceView(**{**BASE.__dict__, "upgrading": True}), UNSCHEDULABLE),
    "a phone in another rack never matches the selector": (
        DeviceView(**{**BASE.__dict__, "labels": {"rack": "b"}}), UNRESOLVABLE),
    "a phone at 10% on battery is below min_battery": (
        DeviceView(**{**BASE.__dict__, "battery_pct": 10}), UNSCHEDULABLE),
    "a phone at 10% but charging is fine": (
        DeviceView(**{**BASE.__dict__, "battery_pct": 10, "charging": True}), None),
    "a phone at 47 C is above max_temp_c": (
        DeviceView(**{**BASE.__dict__, "temp_c": 47}), UNSCHEDULABLE),
    "a phone whose agent lacks the arch cannot run it": (
        DeviceView(**{**BASE.__dict__, "archs": frozenset({"mlp"})}), UNRESOLVABLE),
    "a phone busy with another job is not free": (
        DeviceView(**{**BASE.__dict__, "job_id": "job-b"}), UNSCHEDULABLE),
    "a phone already in this job is free for it": (
        DeviceView(**{**BASE.__dict__, "job_id": "job-a"}), None),
    "a 2 GB phone cannot hold a micro-batch that needs 1500 MiB": (
        DeviceView(**{**BASE.__dict__, "ram_mb": 2000}), UNRESOLVABLE),
    "a 4 GB phone can": (DeviceView(**{**BASE.__dict__, "ram_mb": 4000}), None),
    "a phone with no telemetry yet is not refused for it": (
        DeviceView(id="dev-2", labels={"rack": "a"}, compute_class="be23673d0b4b503b"), None),
}


@pytest.mark.parametrize("case", FILTER_CASES)
def test_filters(case: str) -> None:
    device, expected = FILTER_CASES[case]
    status = run_filters(device, REQ, FILTERS)
    assert (None if status.ok else status.code) == expected, status.reason


KEEP_CASES = {
    "a running phone that got hot keeps its shards until its agent pauses": (
        DeviceView(**{**BASE.__dict__, "temp_c": 60}), True),
    "a paused phone loses its shards": (
        DeviceView(**{**BASE.__dict__, "pause_reason": "busy"}), False),
    "a drained phone loses its shards": (DeviceView(**{**BASE.__dict__, "draining": True}), False),
    "a NotReady phone loses its shards": (
        DeviceView(**{**BASE.__dict__, "state": "NotReady"}), False),
}


def test_a_job_no_phone_could_hold_says_so_with_the_largest_phone() -> None:
    fleet = [DeviceView(id="a", ram_mb=2000), DeviceView(id="b", ram_mb=2800),
             DeviceView(id="c")]
    assert "the largest phone has 1,400 MiB usable" in fits_no_phone(fleet, REQ)
    assert fits_no_phone([*fleet, DeviceView(id="d", ram_mb=3000)], REQ) is None
    assert fits_no_phone([DeviceView(id="c")], REQ) is None  # nobody said: not refused
    assert fits_no_phone(fleet, PlacementRequest(job_id="j", arch="cnn", shards=8)) is None


def test_a_job_needing_what_an_old_agent_does_not_compute_is_kept_off_it() -> None:
    from scheduler.policy.types import job_features

    spec = {"augment": {"horizontal_flip": True}, "upload_precision": "bfloat16"}
    assert job_features(spec) == {"augment", "upload_precision"}
    assert job_features({"augment": {"crop_padding": 0}, "label_smoothing": 0.0}) == set()
    req = PlacementRequest(job_id="j", arch="cnn", shards=4, features=job_features(spec))
    # says nothing of features: computes none of them
    old = DeviceView(id="old", compute_class=BASE.compute_class)
    status = run_filters(old, req)
    assert status.code == UNRESOLVABLE
    assert status.reason == "agent lacks augment, upload_precision (upgrade it)"
    new = DeviceView(id="new", features=frozenset({"augment", "label_smoothing",
                                                   "upload_precision"}),
                     compute_class=BASE.compute_class)
    assert run_filters(new, req).ok
    # what the current agent says it computes covers everything a job can ask
    from agent.runtime.agent import FEATURES

    everything = {"augment": {"crop_padding": 4}, "label_smoothing": 0.1,
                  "upload_precision": "float16", "exactness": "portable"}
    assert job_features(everything) == set(FEATURES)


@pytest.mark.parametrize("case", KEEP_CASES)
def test_keep_filters(case: str) -> None:
    device, keeps = KEEP_CASES[case]
    assert run_filters(device, REQ, KEEP_FILTERS).ok is keeps


def test_measured_speed_beats_the_estimate_and_scores_rank_by_it() -> None:
    slow = DeviceView(**{**BASE.__dict__, "id": "slow", "speeds": {"cnn": 100.0}})
    fast = DeviceView(**{**BASE.__dict__, "id": "fast", "speeds": {"cnn": 400.0}})
    assert device_speed(fast, "cnn") == 400.0
    assert score(fast, REQ, 400.0) > score(slow, REQ, 400.0)


def test_a_cool_charging_phone_scores_above_a_hot_draining_one() -> None:
    cool = DeviceView(**{**BASE.__dict__, "id": "cool", "temp_c": 25, "charging": True})
    hot = DeviceView(**{**BASE.__dict__, "id": "hot", "temp_c": 44, "battery_pct": 25})
    fastest = device_speed(cool, "cnn")
    assert 0 <= score(hot, REQ, fastest) < score(cool, REQ, fastest) <= 100
