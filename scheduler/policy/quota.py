"""Per-user limits at admission (pure): how many jobs one user runs and how many devices their
running jobs hold together. Admins' jobs (owner None) are not limited."""

from __future__ import annotations

from dataclasses import dataclass, replace

from scheduler.policy.types import PlacementRequest


@dataclass(frozen=True)
class UserLimits:
    max_running_jobs: int | None = None
    max_devices: int | None = None


@dataclass(frozen=True)
class Usage:
    """What a user's running jobs hold, the job being placed left out."""

    running_jobs: int = 0
    devices: int = 0


def refusal(owner: str | None, usage: Usage, limits: UserLimits, min_devices: int) -> str | None:
    """Why a user's job may not start now (the Pending job's reason), or None."""
    if owner is None:
        return None
    if limits.max_running_jobs is not None and usage.running_jobs >= limits.max_running_jobs:
        return (f"user {owner} runs {usage.running_jobs} job(s): the limit is "
                f"{limits.max_running_jobs} per user (PHALANX_USER_MAX_RUNNING_JOBS)")
    if limits.max_devices is not None and usage.devices + min_devices > limits.max_devices:
        return (f"user {owner}'s running jobs hold {usage.devices} device(s) and this job needs "
                f"at least {min_devices}: the limit is {limits.max_devices} per user "
                "(PHALANX_USER_MAX_DEVICES)")
    return None


def within_limits(req: PlacementRequest, owner: str | None, usage: Usage,
                  limits: UserLimits) -> PlacementRequest:
    """The request with max_devices lowered to what the user may still hold."""
    if owner is None or limits.max_devices is None:
        return req
    room = max(0, limits.max_devices - usage.devices)
    return replace(req, max_devices=min(req.max_devices, room))
