"""A `class` job's shards stay on one compute class; a portable job goes anywhere its agent
computes the portable path. Pure placement, without a database."""

from __future__ import annotations

from dataclasses import replace

from scheduler.policy.filters import FILTERS, KEEP_FILTERS, UNRESOLVABLE, run_filters
from scheduler.policy.placement import (
    choose_compute_class,
    compute_classes,
    place_gang,
    rebalance,
)
from scheduler.policy.preemption import plan_preemption
from scheduler.policy.types import DeviceView, PlacementRequest, RunningJob, job_features

A, B = "a1" * 8, "b2" * 8  # two compute classes' fingerprints
TODAY = frozenset({"augment", "label_smoothing", "upload_precision", "portable"})


def phone(name: str, cls: str | None, speed: float = 100.0, **kw) -> DeviceView:
    kw.setdefault("features", TODAY)
    return DeviceView(id=name, speeds={"cnn": speed}, battery_pct=90, temp_c=30,
                      compute_class=cls, **kw)


def request(exactness: str, job_id: str = "job-a", **kw) -> PlacementRequest:
    spec = {"model": {"arch": "cnn"}, "shards": 8, "exactness": exactness,
            "placement": {"min_devices": 1, "max_devices": 8}}
    return replace(PlacementRequest.from_spec(job_id, spec), **kw)


# class A: three phones of 100 samples/s; class B: two of 200 (more speed in all); one old agent
FLEET = [phone("a-1", A), phone("a-2", A), phone("a-3", A), phone("b-1", B, 200.0),
         phone("b-2", B, 200.0), phone("old", None)]


def test_a_class_job_lands_on_the_fastest_class_only_and_keeps_it() -> None:
    req = request("class")
    assert req.pinned and "portable" not in req.features
    plan = place_gang(req, FLEET)
    assert plan.admitted and plan.compute_class == B
    assert set(plan.shards.values()) == {"b-1", "b-2"} and len(plan.shards) == 8
    assert plan.filtered == {"another compute class": 3,
                             "agent reports no compute class": 1}
    # once placed, the job is of class B: the filter says so for every other phone
    placed = replace(req, compute_class=B)
    status = run_filters(phone("a-1", A), placed, FILTERS)
    assert status.code == UNRESOLVABLE and status.reason == f"another compute class (the job's is #{B[:8]})"
    assert run_filters(phone("b-3", B), placed, FILTERS).ok


def test_a_join_of_another_class_or_of_an_old_agent_takes_no_shard() -> None:
    req = request("class", compute_class=B)
    holders = [replace(d, job_id="job-a") for d in FLEET if d.compute_class == B]
    current = {k: holders[k % 2].id for k in range(8)}
    joiners = [phone("a-4", A, 1000.0), phone("old-2", None, 1000.0)]
    plan = rebalance(req, holders, joiners, current)
    assert plan.admitted and set(plan.shards.values()) == {"b-1", "b-2"}
    assert plan.shards == current and plan.compute_class == B
    # a joiner of the job's own class does join
    plan = rebalance(req, holders, [*joiners, phone("b-3", B)], current)
    assert set(plan.shards.values()) == {"b-1", "b-2", "b-3"}


def test_a_phone_without_a_fingerprint_never_takes_a_class_jobs_shard() -> None:
    olds = [phone(f"old-{i}", None, 1000.0) for i in range(4)]
    plan = place_gang(request("class"), olds)
    assert not plan.admitted
    assert plan.filtered == {"agent reports no compute class": 4}
    assert "waiting for 1 more device(s)" in plan.reason
    # nor as a holder: a phone whose agent stops reporting its class (or reports another) leaves
    req = request("class", compute_class=A)
    assert run_filters(phone("a-1", A), req, KEEP_FILTERS).ok
    assert not run_filters(phone("a-1", None), req, KEEP_FILTERS).ok
    assert not run_filters(phone("a-1", B), req, KEEP_FILTERS).ok


def test_a_portable_job_needs_the_portable_feature_and_uses_every_class() -> None:
    req = request("portable")
    assert not req.pinned and "portable" in req.features
    assert job_features({"exactness": "class"}) == frozenset()
    fleet = [*FLEET, phone("old-agent", A, features=frozenset({"augment"}))]
    plan = place_gang(req, fleet)
    assert plan.admitted and plan.compute_class is None
    # both classes and even the phone that reports no class: its agent computes portable shards
    assert set(plan.shards.values()) == {"a-1", "a-2", "a-3", "b-1", "b-2", "old"}
    assert plan.filtered == {"agent lacks portable": 1}


def test_the_class_is_chosen_by_total_speed_then_devices_then_fingerprint() -> None:
    req = request("class")
    # speed: three phones of 100 (300) beat two of 140 (280)
    assert choose_compute_class(req, [phone("a-1", A), phone("a-2", A), phone("a-3", A),
                                      phone("b-1", B, 140.0), phone("b-2", B, 140.0)]) == A
    # equal speed: more phones win; all equal: the lowest fingerprint, whatever the order
    assert choose_compute_class(req, [phone("a-1", A, 200.0), phone("b-1", B),
                                      phone("b-2", B)]) == B
    even = [phone("b-1", B), phone("a-1", A)]
    assert choose_compute_class(req, even) == choose_compute_class(req, even[::-1]) == A
    # a class that can hold the gang (min_devices) beats a faster one that cannot
    gang = replace(req, min_devices=2)
    assert [c[0] for c in compute_classes(gang, [phone("a-1", A, 1000.0), phone("b-1", B),
                                                 phone("b-2", B)])] == [B, A]
    assert choose_compute_class(req, [phone("old", None)]) is None


def test_preemption_for_a_class_job_frees_one_class_not_a_mix() -> None:
    req = request("class", job_id="new", priority=5, min_devices=2)
    fleet = [phone("a-1", A, job_id="low-a"), phone("b-1", B, job_id="low-b1"),
             phone("b-2", B, job_id="low-b2"), phone("a-2", A)]
    running = [RunningJob("low-a", 0, frozenset({"a-1"})),
               RunningJob("low-b1", 0, frozenset({"b-1"})),
               RunningJob("low-b2", 0, frozenset({"b-2"}))]
    # class A needs one victim (a-2 is free), class B two: not one of each
    assert plan_preemption(req, fleet, running) == ["low-a"]
