"""The per-user limits at their documented boundaries (docs/deploy.md, PHALANX_USER_MAX_DEVICES:
"a job gets at most what is left, and waits Pending when that is below its `min_devices`";
PHALANX_USER_MAX_RUNNING_JOBS: "running jobs per user"; admins' jobs are not limited): a job
that brings a user exactly to a limit starts, one past it waits with the reason."""

from __future__ import annotations

import pytest

from scheduler.policy.quota import Usage, UserLimits, refusal, within_limits
from scheduler.policy.types import PlacementRequest

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
