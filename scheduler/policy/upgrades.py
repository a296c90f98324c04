"""Agent rollouts: which phones upgrade their agent now, which finished, which gave up.

A rollout names one agent build (version + sha256 of the archive the servers serve) and how
many phones may upgrade at once. A phone upgrades only when it is Ready, not paused or being
drained, and holds no shard: between jobs, never in one. Its agent downloads the archive,
checks the hash, installs it beside the running one and restarts under runit; once it
heartbeats with the new version the upgrade is done. One that does not within the timeout, or
that reports a failure (a bad hash, a new agent that would not start and was rolled back), is
marked failed for that version and not asked again until a rollout is set again (which
retries the failed phones). Agents that do not say `self_upgrade` (older, or not started by
launch.sh) are never asked.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass, field

from wire.states import DeviceState


@dataclass(frozen=True)
class Rollout:
    version: str
    sha256: str
    max_parallel: int


@dataclass(frozen=True)
class AgentView:
    id: str
    state: str
    agent_version: str | None
    pause_reason: str | None = None
    holds_shards: bool = False
    upgrading_to: str | None = None  # the version it was told to install, while it does
    upgrade_started: dt.datetime | None = None
    upgrade_failed: str | None = None  # the last version it could not install
    # its agent says it can install a build and roll it back (started by launch.sh)
    can_upgrade: bool = True


@dataclass
class UpgradePlan:
    start: list[str] = field(default_factory=list)
    done: list[str] = field(default_factory=list)
    timed_out: list[str] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)  # told to upgrade, rollout since changed


def needs_upgrade(device: AgentView, rollout: Rollout) -> bool:
    return (device.can_upgrade and device.agent_version is not None
            and device.agent_version != rollout.version
            and device.upgrade_failed != rollout.version)


def idle(device: AgentView) -> bool:
    return device.state == DeviceState.READY and not device.pause_reason \
        and not device.holds_shards


def plan_upgrades(devices: Sequence[AgentView], rollout: Rollout | None, now: dt.datetime,
                  timeout_s: float) -> UpgradePlan:
    """What the scheduler does this pass; `devices` in a stable order (the first outdated idle
    phones go first)."""
    plan = UpgradePlan()
    in_flight = 0
    for d in devices:
        if d.upgrading_to is None:
            continue
        if d.agent_version == d.upgrading_to:
            plan.done.append(d.id)
        elif rollout is None or d.upgrading_to != rollout.version:
            plan.cancelled.append(d.id)
        elif d.upgrade_started is not None and \
                (now - d.upgrade_started).total_seconds() > timeout_s:
            plan.timed_out.append(d.id)
        else:
            in_flight += 1
    if rollout is None:
        return plan
    for d in devices:
        if in_flight >= rollout.max_parallel:
            break
        if d.upgrading_to is None and needs_upgrade(d, rollout) and idle(d):
            plan.start.append(d.id)
            in_flight += 1
    return plan
