"""The scheduler's pure rules at their documented boundaries: the per-user limits (docs/deploy.md, PHALANX_USER_MAX_DEVICES:
"a job gets at most what is left, and waits Pending when that is below its `min_devices`";
PHALANX_USER_MAX_RUNNING_JOBS: "running jobs per user"; admins' jobs are not limited): a job
that brings a user exactly to a limit starts, one past it waits with the reason. Then a job's
request as its spec gives it (and the defaults docs/api.md lists), preemption, stragglers and
agent rollouts; with tests/scheduler/test_policy_reasons.py, what `scripts/mutation policy`
judges scheduler/policy/ by (docs/testing.md)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass, replace

import pytest

from scheduler.policy.preemption import plan_preemption
from scheduler.policy.quota import Usage, UserLimits, refusal, within_limits
from scheduler.policy.straggler import expected_step_s, plan_backups, straggler_timeout
from scheduler.policy.types import (
    DeviceView,
    PlacementRequest,
    RunningJob,
    job_exactness,
    job_features,
)
from scheduler.policy.upgrades import AgentView, Rollout, plan_upgrades

LIMITS = UserLimits(max_running_jobs=2, max_devices=8)


def test_a_job_that_brings_the_user_exactly_to_the_device_limit_starts() -> None:
    assert refusal("alice", Usage(running_jobs=1, devices=5), LIMITS, min_devices=3) is None
    assert refusal("alice", Usage(devices=0), LIMITS, min_devices=8) is None


def test_a_job_one_device_past_the_limit_waits_naming_it() -> None:
    assert refusal("alice", Usage(running_jobs=1, devices=5), LIMITS, min_devices=4) == (
        "user alice's running jobs hold 5 device(s) and this job needs at least 4: the limit is "
        "8 per user (PHALANX_USER_MAX_DEVICES)")
    assert refusal("alice", Usage(devices=0), LIMITS, min_devices=9) is not None


def test_the_running_jobs_limit_counts_the_jobs_already_running() -> None:
    assert refusal("alice", Usage(running_jobs=1), LIMITS, min_devices=1) is None
    assert refusal("alice", Usage(running_jobs=2), LIMITS, min_devices=1) == (
        "user alice runs 2 job(s): the limit is 2 per user (PHALANX_USER_MAX_RUNNING_JOBS)")


@pytest.mark.parametrize("usage, min_devices", [(Usage(running_jobs=50, devices=50), 50),
                                                (Usage(), 1)])
def test_no_limit_set_and_an_admin_s_job_are_never_refused(usage, min_devices) -> None:
    assert refusal("alice", usage, UserLimits(), min_devices) is None
    assert refusal(None, usage, LIMITS, min_devices) is None


def test_a_job_gets_at_most_the_devices_its_user_has_left() -> None:
    req = PlacementRequest(job_id="j", arch="mlp", shards=16, max_devices=6)
    assert within_limits(req, "alice", Usage(devices=5), LIMITS).max_devices == 3
    assert within_limits(req, "alice", Usage(devices=1), LIMITS).max_devices == 6  # its own cap
    assert within_limits(req, "alice", Usage(devices=8), LIMITS).max_devices == 0
    assert within_limits(req, "alice", Usage(devices=12), LIMITS).max_devices == 0  # never < 0
    assert within_limits(req, None, Usage(devices=8), LIMITS) is req
    assert within_limits(req, "alice", Usage(devices=8), UserLimits(max_running_jobs=1)) is req


# --- a job's request, read from its spec ----------------------------------------------------

def test_a_spec_s_placement_becomes_the_request() -> None:
    spec = {"model": {"arch": "resnet"}, "shards": 32, "priority": 7, "exactness": "portable",
            "augment": {"horizontal_flip": True}, "label_smoothing": 0.1,
            "upload_precision": "bfloat16",
            "placement": {"min_devices": 3, "max_devices": 12, "selector": {"rack": "b"},
                          "min_battery": 35, "max_temp_c": 41.5, "backend": "torch"}}
    req = PlacementRequest.from_spec("job-x", spec, priority=1, memory_mb=250.0,
                                     compute_class="abcd")
    assert req == PlacementRequest(
        job_id="job-x", arch="resnet", shards=32, min_devices=3, max_devices=12,
        selector={"rack": "b"}, min_battery=35.0, max_temp_c=41.5, backend="torch", priority=7,
        memory_mb=250.0, features=frozenset({"augment", "label_smoothing", "upload_precision",
                                             "portable"}),
        exactness="portable", compute_class="abcd")


def test_a_bare_spec_takes_the_documented_placement_defaults() -> None:
    """docs/api.md: min_devices 1, max_devices 8, selector {}, min_battery 20, max_temp_c 45,
    backend any, shards 16, exactness class."""
    assert PlacementRequest.from_spec("job-y", {}).priority == 0
    req = PlacementRequest.from_spec("job-y", {}, priority=4)
    assert (req.arch, req.shards, req.min_devices, req.max_devices, dict(req.selector)) == (
        "", 16, 1, 8, {})
    assert (req.min_battery, req.max_temp_c, req.backend, req.priority) == (20.0, 45.0, "any", 4)
    assert (req.features, req.exactness, req.memory_mb, req.compute_class) == (
        frozenset(), "class", None, None)
    assert job_exactness({}) == "class" and job_features({"augment": {"crop_padding": 0}}) == set()


@dataclass
class Job:
    id: str
    spec: dict
    priority: int = 0
    plan: dict | None = None
    compute_class: str | None = None


def test_a_job_s_plan_gives_its_memory_per_phone_in_mib() -> None:
    job = Job("job-z", {"shards": 4}, 2, {"memory_per_device_bytes": 3 * 2**20}, "ffff")
    req = PlacementRequest.for_job(job)
    assert (req.job_id, req.shards, req.priority, req.memory_mb, req.compute_class) == (
        "job-z", 4, 2, 3.0, "ffff")
    assert PlacementRequest.for_job(Job("j", {}, plan={"memory_per_device_bytes": "?"})
                                    ).memory_mb is None
    assert PlacementRequest.for_job(Job("j", {})).memory_mb is None


# --- preemption -----------------------------------------------------------------------------

def fleet(owners: dict[str, str | None], compute_class: str | None = None) -> list[DeviceView]:
    return [DeviceView(id=d, job_id=j, compute_class=compute_class) for d, j in owners.items()]


PORTABLE = PlacementRequest(job_id="new", arch="cnn", shards=8, min_devices=3, priority=10,
                            exactness="portable")


def test_a_portable_job_preempts_only_as_many_jobs_as_it_needs() -> None:
    devices = fleet({"d1": None, "d2": "x", "d3": "y", "d4": "y"})
    running = [RunningJob("x", 0, frozenset({"d2"})), RunningJob("y", 0, frozenset({"d3", "d4"}))]
    assert plan_preemption(PORTABLE, devices, running) == ["x", "y"]  # 1 + 1 + 2 >= 3
    assert plan_preemption(replace(PORTABLE, min_devices=1), devices, running) == []  # fits
    exactly = fleet({"d1": None, "d2": None, "d3": None, "d4": "x"})
    assert plan_preemption(PORTABLE, exactly, running) == []  # exactly min_devices free
    assert plan_preemption(replace(PORTABLE, min_devices=9), devices, running) == []  # hopeless


def test_a_placed_class_job_preempts_on_its_own_class_only() -> None:
    req = replace(PORTABLE, exactness="class", compute_class="A", min_devices=2)
    devices = [*fleet({"a1": "x", "a2": "y"}, "A"), *fleet({"b1": None, "b2": "z"}, "B")]
    running = [RunningJob(j, 0, frozenset()) for j in ("x", "y", "z")]
    assert plan_preemption(req, devices, running) == ["x", "y"]


def test_an_unplaced_class_job_counts_each_class_apart_and_takes_the_fewest_victims() -> None:
    req = replace(PORTABLE, exactness="class", min_devices=2)
    devices = [*fleet({"a1": None, "a2": "x"}, "A"), *fleet({"b1": None, "b2": "y"}, "B")]
    running = [RunningJob("x", 0, frozenset({"a2"})), RunningJob("y", 0, frozenset({"b2"}))]
    assert plan_preemption(req, devices, running) == ["x"]  # not 2 free across classes
    more = [*fleet({"a1": "j1", "a2": "j2"}, "A"), *fleet({"b1": None, "b2": "j9"}, "B")]
    jobs = [RunningJob(j, 0, frozenset()) for j in ("j1", "j2", "j9")]
    assert plan_preemption(req, more, jobs) == ["j9"]  # one victim beats two


# --- stragglers -----------------------------------------------------------------------------

def test_a_device_is_late_after_3_times_the_median_of_the_others() -> None:
    """docs/scheduler.md: `max(floor, 3 x the median of the devices' measured step times)`;
    a device that measured nothing (0) is not in the median."""
    assert straggler_timeout(2.0, floor_s=1.0) == 6.0
    assert expected_step_s({"a": 0.0, "b": 4.0, "c": 6.0}) == 5.0
    assert expected_step_s({"a": 0.0}, fallback=7.0) == 7.0


def test_backups_go_round_robin_over_every_helper() -> None:
    plan = plan_backups({"slow": [1, 2, 3, 4]}, ["h1", "h2", "h3"])
    assert plan == {1: "h1", 2: "h2", 3: "h3", 4: "h1"}
    # a straggler that is the only helper skips its own shards, not the others'
    assert plan_backups({"a": [1], "b": [2]}, ["a"]) == {2: "a"}


def test_a_shard_is_never_backed_up_by_its_auditor_and_the_next_shard_still_is() -> None:
    """docs/scheduler.md (Audits): an audit compares two devices' results, so the auditor of a
    shard never computes its backup; a shard nobody may back up leaves the others' plans."""
    auditing = {5: frozenset({"h1"}), 6: frozenset({"h1", "h2"})}
    plan = plan_backups({"slow": [5, 6, 7]}, ["h1", "h2"], auditing=auditing)
    assert plan == {5: "h2", 7: "h2"}  # 6: both helpers audit it; 7: the second turn
    assert plan_backups({"slow": [5]}, ["h1"], auditing={4: frozenset({"h1"})}) == {5: "h1"}


# --- agent rollouts -------------------------------------------------------------------------

NOW = dt.datetime(2026, 12, 7, 12, 0, tzinfo=dt.timezone.utc)
ROLLOUT = Rollout("0.2.0", "ab" * 32, max_parallel=2)


def agent(i: int, **kw) -> AgentView:
    return AgentView(**{"id": f"dev-{i}", "state": "Ready", "agent_version": "0.1.0", **kw})


def test_an_upgrade_times_out_strictly_after_the_timeout() -> None:
    """docs/deploy.md, PHALANX_AGENT_UPGRADE_TIMEOUT_S (600): at 600 s it is still in flight."""
    at = agent(0, upgrading_to="0.2.0", upgrade_started=NOW - dt.timedelta(seconds=600))
    past = agent(1, upgrading_to="0.2.0",
                 upgrade_started=NOW - dt.timedelta(seconds=600, milliseconds=1))
    plan = plan_upgrades([at, past, agent(2), agent(3)], ROLLOUT, NOW, 600)
    assert plan.timed_out == ["dev-1"] and plan.start == ["dev-2"]


def test_every_phone_in_flight_counts_wherever_it_is_listed() -> None:
    started = NOW - dt.timedelta(seconds=5)
    fleet_ = [agent(0), agent(1, upgrading_to="0.2.0", upgrade_started=started),
              agent(2, upgrading_to="0.2.0", upgrade_started=started)]
    assert plan_upgrades(fleet_, ROLLOUT, NOW, 600).start == []
