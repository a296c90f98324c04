"""Shard balancing, gang placement, preemption, eviction rate limit and backups, without a DB."""

from __future__ import annotations

import pytest

from scheduler.policy.eviction import EvictionLimits, allowed_evictions
from scheduler.policy.placement import place_gang, rebalance
from scheduler.policy.preemption import plan_preemption
from scheduler.policy.shards import balance_shards, moved_shards, proportional_counts
from scheduler.policy.straggler import (
    demoted_speeds,
    expected_step_s,
    persistent_stragglers,
    plan_backups,
    straggler_timeout,
)
from scheduler.policy.types import DeviceView, PlacementRequest, RunningJob

CLASS_A = "a1" * 8  # a compute class's fingerprint


def phone(i: int | str, speed: float = 100.0, **kw) -> DeviceView:
    """A phone of compute class A (unless `compute_class` says), as an agent of today reports."""
    ident = i if isinstance(i, str) else f"dev-{i:03d}"
    kw.setdefault("compute_class", CLASS_A)
    return DeviceView(id=ident, speeds={"cnn": speed}, battery_pct=90, temp_c=30, **kw)


COUNT_CASES = {
    "equal phones split 16 shards evenly": (16, {"a": 1, "b": 1, "c": 1, "d": 1}, {"a": 4, "b": 4, "c": 4, "d": 4}),
    "a phone twice as fast gets twice the shards": (12, {"a": 2, "b": 1, "c": 1}, {"a": 6, "b": 3, "c": 3}),
    "the largest remainders get the leftover shards": (10, {"a": 1, "b": 1, "c": 1}, {"a": 4, "b": 3, "c": 3}),
    "a very slow phone still gets one shard": (8, {"fast": 100, "slow": 1}, {"fast": 7, "slow": 1}),
    "no measured speed at all splits evenly": (4, {"a": 0, "b": 0}, {"a": 2, "b": 2}),
}


@pytest.mark.parametrize("case", COUNT_CASES)
def test_proportional_counts(case: str) -> None:
    total, weights, expected = COUNT_CASES[case]
    counts = proportional_counts(total, weights)
    assert counts == expected
    assert sum(counts.values()) == total


def test_balancing_keeps_shards_where_they_are_when_counts_allow() -> None:
    before = {0: "a", 1: "a", 2: "b", 3: "b", 4: "c", 5: "c"}
    after = balance_shards(6, {"a": 1, "b": 1}, before)  # c left
    assert after[0] == "a" and after[1] == "a" and after[2] == "b" and after[3] == "b"
    assert moved_shards(before, after) == [4, 5]
    assert sorted(after.values()).count("a") == 3


def test_a_joining_phone_takes_shards_from_the_others_only() -> None:
    before = {k: ("a" if k < 4 else "b") for k in range(8)}
    after = balance_shards(8, {"a": 1, "b": 1, "c": 1, "d": 1}, before)
    assert sorted(after) == list(range(8))
    assert all(after[k] == before[k] for k in (0, 1, 4, 5))
    assert {after[k] for k in moved_shards(before, after)} <= {"c", "d"}


def test_balancing_is_deterministic() -> None:
    speeds = {f"d{i}": float(1 + i % 3) for i in range(7)}
    assert balance_shards(32, speeds, {}) == balance_shards(32, dict(reversed(speeds.items())), {})


REQ = PlacementRequest(job_id="job-a", arch="cnn", shards=8, min_devices=3, max_devices=4)

GANG_CASES = {
    "two phones are not enough for min_devices 3": ([phone(1), phone(2)], False, 0),
    "three phones admit the gang": ([phone(1), phone(2), phone(3)], True, 3),
    "six phones give max_devices 4": ([phone(i) for i in range(6)], True, 4),
    "cordoned phones do not count toward min_devices": (
        [phone(1), phone(2), phone(3, cordoned=True)], False, 0),
    "phones of another job do not count": ([phone(1), phone(2), phone(3, job_id="job-b")], False, 0),
}


@pytest.mark.parametrize("case", GANG_CASES)
def test_gang_admission(case: str) -> None:
    devices, admitted, n = GANG_CASES[case]
    plan = place_gang(REQ, devices)
    assert plan.admitted is admitted
    assert len(plan.devices) == n
    if admitted:
        assert sorted(plan.shards) == list(range(REQ.shards))
    else:
        assert "min_devices 3" in plan.reason


def test_never_more_devices_than_shards() -> None:
    """A device without a shard does nothing: 3 shards take 3 phones, whatever max_devices."""
    req = PlacementRequest(job_id="few", arch="cnn", shards=3, min_devices=1, max_devices=8)
    plan = place_gang(req, [phone(i) for i in range(6)])
    assert plan.admitted and len(plan.devices) == 3
    assert sorted(plan.shards) == [0, 1, 2] and len(set(plan.shards.values())) == 3
    holders = [d for d in (phone(i) for i in range(6)) if d.id in plan.devices]
    joiners = [d for d in (phone(i) for i in range(6)) if d.id not in plan.devices]
    joined = rebalance(req, holders, joiners, dict(plan.shards))
    assert len(joined.devices) == 3 and set(joined.shards.values()) == set(plan.devices)


def test_the_fastest_phones_are_picked_and_get_more_shards() -> None:
    devices = [phone(1, 50), phone(2, 400), phone(3, 400), phone(4, 200), phone(5, 400)]
    plan = place_gang(REQ, devices)
    assert set(plan.devices) == {"dev-002", "dev-003", "dev-005", "dev-004"}
    counts = {d: list(plan.shards.values()).count(d) for d in plan.devices}
    assert counts["dev-004"] < counts["dev-002"]


def test_a_gang_of_138_fits_in_a_fleet_of_10000() -> None:
    req = PlacementRequest(job_id="big", arch="cnn", shards=552, min_devices=138, max_devices=138)
    fleet = [phone(i, 100 + i % 17, state="NotReady" if i % 5 == 0 else "Ready") for i in range(10_000)]
    plan = place_gang(req, fleet)
    assert plan.admitted and len(plan.devices) == 138
    assert plan.filtered.get("not ready") == 2000


def test_rebalance_below_min_devices_waits() -> None:
    holders = [phone(1), phone(2, pause_reason="thermal"), phone(3, state="NotReady")]
    current = {k: holders[k % 3].id for k in range(8)}
    plan = rebalance(REQ, holders, [], current)
    assert not plan.admitted and "waiting for 2 more device(s) (min_devices 3" in plan.reason


def test_rebalance_moves_only_the_departed_phones_shards() -> None:
    req = PlacementRequest(job_id="job-a", arch="cnn", shards=8, min_devices=1, max_devices=4)
    holders = [phone(1), phone(2), phone(3), phone(4, draining=True)]
    current = {k: holders[k % 4].id for k in range(8)}
    plan = rebalance(req, holders, [], current)
    assert plan.admitted and "dev-004" not in plan.devices
    assert set(moved_shards(current, plan.shards)) == {3, 7}


def test_a_held_back_notready_phone_keeps_its_shards() -> None:
    req = PlacementRequest(job_id="job-a", arch="cnn", shards=4, min_devices=1, max_devices=4)
    holders = [phone(1), phone(2, state="NotReady")]
    current = {0: "dev-001", 1: "dev-002", 2: "dev-001", 3: "dev-002"}
    plan = rebalance(req, holders, [], current, force_keep=frozenset({"dev-002"}))
    assert plan.shards == current


PREEMPT_CASES = {
    "a higher priority job takes a lower one's phones": (
        10, [RunningJob("low", 0, frozenset({"dev-001", "dev-002", "dev-003"}))], ["low"]),
    "an equal priority job never preempts": (
        0, [RunningJob("low", 0, frozenset({"dev-001", "dev-002", "dev-003"}))], []),
    "the lowest priority goes first and only as many as needed": (
        10, [RunningJob("mid", 5, frozenset({"dev-001", "dev-002"})),
             RunningJob("low", 1, frozenset({"dev-003", "dev-004", "dev-005"}))], ["low"]),
}


@pytest.mark.parametrize("case", PREEMPT_CASES)
def test_preemption(case: str) -> None:
    priority, running, victims = PREEMPT_CASES[case]
    owner = {d: j.id for j in running for d in j.devices}
    devices = [phone(i, job_id=owner.get(f"dev-{i:03d}")) for i in range(1, 6)]
    req = PlacementRequest(job_id="new", arch="cnn", shards=8, min_devices=3, priority=priority)
    assert plan_preemption(req, devices, running) == victims


def test_preemption_that_cannot_reach_min_devices_preempts_nobody() -> None:
    running = [RunningJob("low", 0, frozenset({"dev-001"}))]
    devices = [phone(1, job_id="low")]
    req = PlacementRequest(job_id="new", arch="cnn", shards=8, min_devices=3, priority=5)
    assert plan_preemption(req, devices, running) == []


EVICTION_CASES = {
    "one phone of ten lost its lease: evict": (10, 1, [], 1000),
    "all the phones in one rack are down: evict slowly": (10, 6, [], 1),
    "the slow budget was used a moment ago: wait": (10, 6, [95.0], 0),
    "the slow budget was used two minutes ago: evict one": (10, 6, [-30.0], 1),
    "a fleet of two tells nothing about disruption": (2, 2, [], 1000),
}


@pytest.mark.parametrize("case", EVICTION_CASES)
def test_eviction_rate_limit(case: str) -> None:
    fleet, not_ready, recent, allowed = EVICTION_CASES[case]
    assert allowed_evictions(fleet, not_ready, recent, now=100.0, limits=EvictionLimits()) == allowed


def test_straggler_timeout_follows_the_median_with_a_floor() -> None:
    assert expected_step_s({"a": 1.0, "b": 1.2, "c": 30.0}) == 1.2
    assert straggler_timeout(1.2, floor_s=2.0, factor=3.0) == pytest.approx(3.6)
    assert straggler_timeout(0.1, floor_s=2.0) == 2.0
    assert straggler_timeout(None, floor_s=2.0) == 20.0


def test_backups_go_round_robin_to_helpers_never_to_the_straggler() -> None:
    plan = plan_backups({"slow": [5, 6, 7]}, ["fast1", "fast2", "slow"], frozenset({6}))
    assert plan == {5: "fast1", 7: "fast2"}
    assert plan_backups({"slow": [1]}, ["slow"]) == {}


def test_a_device_late_two_steps_running_is_a_persistent_straggler() -> None:
    late = {"slow": [3, 4], "once": [4], "earlier": [1, 2]}
    assert persistent_stragglers(late, finished_step=4) == ["slow"]
    assert demoted_speeds({"slow": 100.0, "fast": 100.0}, {"slow": 0.5}) == {"slow": 50.0, "fast": 100.0}
