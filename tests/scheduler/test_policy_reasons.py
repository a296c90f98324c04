"""What an operator reads and where each rule turns (issue 44 items 2 and 3): every filter's
reason word for word (a Pending job's reason counts them: "excluded: 3 paused, 1 cordoned"),
each filter's boundary as docs/api.md gives it (`placement.min_battery`: a phone at exactly the
minimum takes work; `placement.max_temp_c`: at exactly the limit too), the scores' ranges, and
the shard split's corner cases. Pure functions, table-driven; also what `scripts/mutation
policy` judges scheduler/policy/ by (docs/testing.md)."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import replace

import pytest

from scheduler.policy.filters import (
    FILTERS,
    OK,
    SUCCESS,
    UNRESOLVABLE,
    UNSCHEDULABLE,
    FilterStatus,
    capability,
    memory,
    run_filters,
)
from scheduler.policy.placement import (
    OTHER_CLASS,
    compute_classes,
    keepable,
    pick,
    place_gang,
    rebalance,
    waiting_reason,
)
from scheduler.policy.scores import (
    DEFAULT_SAMPLES_PER_CORE,
    EST_SAMPLES_PER_CORE,
    battery_score,
    device_speed,
    speed_score,
    thermal_score,
)
from scheduler.policy.shards import proportional_counts
from scheduler.policy.types import MAX_SPEED, DeviceView, PlacementRequest

REQ = PlacementRequest(job_id="job-a", arch="cnn", shards=8, min_battery=20, max_temp_c=45,
                       selector={"rack": "a"}, exactness="portable")
PHONE = DeviceView(id="dev-1", labels={"rack": "a"}, battery_pct=80, charging=False, temp_c=35)


def phone(**changes) -> DeviceView:
    return replace(PHONE, **changes)


# --- filters --------------------------------------------------------------------------------

REASONS = {
    "not ready": (phone(state="NotReady"), REQ, UNSCHEDULABLE, "not ready (NotReady)"),
    "cordoned by flag": (phone(cordoned=True), REQ, UNRESOLVABLE, "cordoned"),
    "cordoned by state": (phone(state="Cordoned"), replace(REQ), UNSCHEDULABLE,
                          "not ready (Cordoned)"),
    "draining": (phone(draining=True), REQ, UNRESOLVABLE, "draining"),
    "paused": (phone(pause_reason="thermal"), REQ, UNSCHEDULABLE, "paused (thermal)"),
    "upgrading": (phone(upgrading=True), REQ, UNSCHEDULABLE, "installing a new agent"),
    "selector": (phone(labels={"rack": "b"}), REQ, UNRESOLVABLE, "label rack!=a"),
    "arch": (phone(archs=frozenset({"mlp"})), REQ, UNRESOLVABLE, "agent lacks arch cnn"),
    "backend": (phone(backends=frozenset({"numpy"})), replace(REQ, backend="torch"),
                UNRESOLVABLE, "agent lacks backend torch"),
    "features": (phone(), replace(REQ, features=frozenset({"portable", "augment"})),
                 UNRESOLVABLE, "agent lacks augment, portable (upgrade it)"),
    "no compute class": (phone(), replace(REQ, exactness="class"), UNRESOLVABLE,
                         "agent reports no compute class (upgrade it)"),
    "another compute class": (phone(compute_class="aaaaaaaa11"),
                              replace(REQ, exactness="class", compute_class="bbbbbbbb22"),
                              UNRESOLVABLE, "another compute class (the job's is #bbbbbbbb)"),
    "memory": (phone(ram_mb=2000), replace(REQ, memory_mb=1500), UNRESOLVABLE,
               "too little memory (needs 1,500 MiB per micro-batch, 1,000 MiB usable of 2,000)"),
    "battery": (phone(battery_pct=19.5), REQ, UNSCHEDULABLE, "battery 19.5% < 20%"),
    "temperature": (phone(temp_c=45.5), REQ, UNSCHEDULABLE, "too hot (45.5 C > 45 C)"),
    "busy": (phone(job_id="job-b"), REQ, UNSCHEDULABLE, "busy with another job"),
}


@pytest.mark.parametrize("case", REASONS)
def test_a_refused_phone_is_refused_with_its_reason(case: str) -> None:
    device, req, code, reason = REASONS[case]
    assert run_filters(device, req, FILTERS) == FilterStatus(code, reason)


@pytest.mark.parametrize("device", [
    phone(battery_pct=20),  # exactly min_battery: takes work
    phone(battery_pct=5, charging=True),  # charging: the minimum does not apply
    phone(temp_c=45),  # exactly max_temp_c
    phone(ram_mb=3000),  # 1500 MiB needed of exactly 1500 usable
    phone(battery_pct=None, temp_c=None, ram_mb=None),  # nothing reported yet
    phone(backends=frozenset({"torch"}), job_id="job-a"),
], ids=["battery at the minimum", "charging", "temperature at the limit", "memory exactly",
        "nothing reported", "torch phone already in the job"])
def test_a_phone_at_a_boundary_takes_work(device: DeviceView) -> None:
    req = replace(REQ, memory_mb=1500, backend="torch" if device.backends else "any")
    assert run_filters(device, req, FILTERS) == OK and OK.ok and OK.code == SUCCESS


def test_a_backend_is_checked_only_when_the_job_names_one_and_the_agent_says() -> None:
    torch_job = replace(REQ, backend="torch")
    assert capability(phone(backends=None), torch_job) == OK  # the agent did not say
    assert capability(phone(backends=frozenset({"numpy"})), REQ) == OK  # "any"
    assert capability(phone(backends=frozenset({"numpy", "torch"})), torch_job) == OK
    assert capability(phone(archs=None), REQ) == OK and memory(phone(ram_mb=10), REQ) == OK


# --- scores ---------------------------------------------------------------------------------

@pytest.mark.parametrize("speeds, cores, arch, expected", [
    ({"cnn": 0.5}, 4, "cnn", 0.5),  # a slow measurement is still a measurement
    ({"cnn": MAX_SPEED}, 4, "cnn", MAX_SPEED),
    ({"cnn": MAX_SPEED * 2}, 4, "cnn", 400.0 * 4),  # beyond the bound: not measured
    ({"cnn": 0.0}, 4, "cnn", 400.0 * 4),
    ({"cnn": math.nan}, 4, "cnn", 400.0 * 4),
    ({}, 0, "cnn", 400.0),  # at least one core
    ({}, 5000, "cnn", 400.0 * 1024),  # at most 1024
    ({}, 2, "transformer", DEFAULT_SAMPLES_PER_CORE * 2),
    ({}, 2, "logreg", EST_SAMPLES_PER_CORE["logreg"] * 2),
])
def test_a_device_s_speed_is_measured_or_estimated_and_always_bounded(speeds, cores, arch,
                                                                       expected) -> None:
    assert device_speed(phone(speeds=speeds, cpu_cores=cores), arch) == expected


def test_a_core_count_that_is_not_an_integer_counts_as_one_core() -> None:
    assert device_speed(phone(cpu_cores=3.5), "cnn") == 400.0  # type: ignore[arg-type]


def test_speed_scores_are_relative_to_the_fastest() -> None:
    slow = phone(speeds={"cnn": 0.25})
    assert speed_score(slow, REQ, 0.5) == 50.0
    assert speed_score(slow, REQ, 0.0) == 0.0  # no fastest (nothing to compare with)


@pytest.mark.parametrize("temp, expected", [(None, 50.0), (35, 50.0), (25, 100.0), (5, 100.0),
                                            (45, 0.0), (60, 0.0)])
def test_thermal_score_is_headroom_below_the_limit_20_c_full(temp, expected) -> None:
    assert thermal_score(phone(temp_c=temp), REQ) == expected


@pytest.mark.parametrize("battery, charging, expected", [(None, False, 50.0), (30, True, 100.0),
                                                         (0, False, 0.0), (64.5, False, 64.5),
                                                         (150, False, 100.0)])
def test_battery_score_is_the_charge_or_full_while_charging(battery, charging, expected) -> None:
    assert battery_score(phone(battery_pct=battery, charging=charging), REQ) == expected


# --- placement ------------------------------------------------------------------------------

def test_the_waiting_reason_counts_the_exclusions_most_first() -> None:
    why = Counter({"cordoned": 1, "paused": 3})
    assert waiting_reason(replace(REQ, min_devices=4), 1, why) == (
        "waiting for 3 more device(s) (min_devices 4, 1 eligible); excluded: 3 paused, "
        "1 cordoned")
    assert waiting_reason(replace(REQ, min_devices=2), 0, Counter()) == (
        "waiting for 2 more device(s) (min_devices 2, 0 eligible)")


def test_a_pending_job_s_reason_names_filters_by_kind() -> None:
    fleet = [phone(id="p1", pause_reason="battery"), phone(id="p2", pause_reason="thermal"),
             phone(id="p3", cordoned=True), phone(id="p4")]
    placed = place_gang(replace(REQ, min_devices=2), fleet)
    assert not placed.admitted and placed.filtered == {"paused": 2, "cordoned": 1}
    assert placed.reason.endswith("excluded: 2 paused, 1 cordoned")


def test_pick_takes_the_best_n_and_none_for_zero() -> None:
    a, b = phone(id="a"), phone(id="b", temp_c=25)
    assert pick(REQ, [a, b], 1) == [b] and pick(REQ, [a, b], 0) == [] and pick(REQ, [], 3) == []


def test_pick_weighs_speed_against_the_fastest_for_the_job_s_arch() -> None:
    """A twice-as-fast phone that is hot and flat loses to a cool, full one (60% speed, 25%
    heat, 15% battery): only when speed is scored against the fastest for this arch."""
    hot = phone(id="hot", cpu_cores=8, temp_c=45, battery_pct=0)
    cool = phone(id="cool", cpu_cores=4, temp_c=25, battery_pct=100)
    assert pick(REQ, [hot, cool], 1) == [cool]


def test_compute_classes_tie_on_speed_and_count_goes_to_the_lowest_fingerprint() -> None:
    fleet = [phone(id="a1", compute_class="bbbb"), phone(id="b1", compute_class="aaaa")]
    assert [c[0] for c in compute_classes(REQ, fleet)] == ["aaaa", "bbbb"]


def test_a_class_job_on_one_class_counts_no_other_class() -> None:
    fleet = [phone(id=f"p{i}", compute_class="aaaa") for i in range(3)]
    placed = place_gang(replace(REQ, exactness="class", min_devices=2), fleet)
    assert placed.admitted and placed.compute_class == "aaaa"
    assert OTHER_CLASS not in placed.filtered
    mixed = [*fleet, phone(id="q", compute_class="bbbb")]
    assert place_gang(replace(REQ, exactness="class"), mixed).filtered == {OTHER_CLASS: 1}


def test_a_holder_keeps_its_shards_through_what_only_the_agent_judges() -> None:
    """Heat and battery are the agent's to judge (it pauses itself): a holder that is hot
    stays; one an admin cordoned does not."""
    assert keepable(REQ, phone(temp_c=60, battery_pct=1))
    assert not keepable(REQ, phone(cordoned=True))


def test_rebalance_takes_joiners_only_up_to_the_wanted_devices() -> None:
    req = replace(REQ, min_devices=1, max_devices=2)
    holders = [phone(id="h1"), phone(id="h2")]
    joiners = [phone(id="j1"), phone(id="j2"), phone(id="j3")]
    current = {s: ("h1" if s < 4 else "h2") for s in range(8)}
    assert rebalance(req, holders, joiners, current).devices == ("h1", "h2")
    assert rebalance(req, holders[:1], joiners, current).devices == ("h1", "j1")


def test_rebalance_at_exactly_min_devices_is_admitted_and_below_waits_with_counts() -> None:
    req = replace(REQ, min_devices=2)
    holders = [phone(id="h1")]
    current = {s: "h1" for s in range(8)}
    placed = rebalance(req, holders, [phone(id="j1"), phone(id="j2", cordoned=True)], current)
    assert placed.admitted is True and placed.devices == ("h1", "j1")
    assert placed.filtered == {"cordoned": 1}
    waiting = rebalance(req, holders, [phone(id="j2", cordoned=True)], current)
    assert waiting.admitted is False and waiting.filtered == {"cordoned": 1}
    assert waiting.reason == ("waiting for 1 more device(s) (min_devices 2, 1 eligible); "
                              "excluded: 1 cordoned")


def test_rebalance_splits_shards_by_the_speed_measured_for_the_job_s_arch() -> None:
    fast = phone(id="fast", speeds={"cnn": 300.0}, cpu_cores=1)
    slow = phone(id="slow", speeds={"cnn": 100.0}, cpu_cores=8)
    placed = rebalance(replace(REQ, max_devices=2), [fast, slow], [], {})
    assert Counter(placed.shards.values()) == {"fast": 6, "slow": 2}


# --- the shard split ------------------------------------------------------------------------

@pytest.mark.parametrize("total, weights, counts", [
    (0, {"a": 1.0, "b": 1.0}, {"a": 0, "b": 0}),
    (-1, {"a": 1.0, "b": 1.0}, {"a": 0, "b": 0}),
    (5, {}, {}),
    (1, {"a": 1.0, "b": 2.0}, {"a": 0, "b": 1}),
    (8, {"a": 2.0, "b": 6.0}, {"a": 2, "b": 6}),
    (4, {"a": 1.0, "b": 2.0}, {"a": 1, "b": 3}),  # the larger remainder, not the lower name
    (6, {"a": 2.0, "b": 5.0}, {"a": 2, "b": 4}),  # remainder .71 beats .29 despite the count
    (4, {"a": "fast", "b": 1.0}, {"a": 1, "b": 3}),  # not a number: lifted from zero only
    (4, {"a": -1.0, "b": 1.0}, {"a": 1, "b": 3}),
    (4, {"a": math.inf, "b": 1.0}, {"a": 1, "b": 3}),
    (4, {"a": math.nan, "b": 1.0}, {"a": 1, "b": 3}),
    (4, {"a": 0.0, "b": 0.0}, {"a": 2, "b": 2}),  # all zero: even
    (2, {"a": 1.0, "b": 3.0, "c": 100.0}, {"a": 0, "b": 1, "c": 1}),  # zeros lifted by quota
    (4, {"a": 10.0, "b": 9.0, "z": 0.0}, {"a": 2, "b": 1, "z": 1}),  # the smaller quota gives
    (4, {"a": 1.6e308, "b": 1.2e308}, {"a": 2, "b": 2}),  # no sum or product overflows
    (5, {"a": 1e-300, "b": 4e-300}, {"a": 1, "b": 4}),
])
def test_shards_split_by_largest_remainder_and_zeros_are_lifted(total, weights, counts) -> None:
    assert proportional_counts(total, weights) == counts
