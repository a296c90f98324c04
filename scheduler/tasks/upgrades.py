"""The rollout pass (under the placement lock, after placement): tell a few idle phones to
install the rollout's agent build, and close the upgrades that finished, failed or were
called off (the rules: scheduler.policy.upgrades)."""

from __future__ import annotations

import datetime as dt

from sqlalchemy import select
from sqlalchemy.orm import Session

from domain.store import rollouts
from domain.store.events import record
from domain.store.models import Device
from scheduler import store_ops
from scheduler.policy.upgrades import AgentView, Rollout, UpgradePlan, plan_upgrades


def agent_views(session: Session) -> dict[str, tuple[Device, AgentView]]:
    holds = store_ops.device_jobs(session)
    out = {}
    for d in session.scalars(select(Device).order_by(Device.id)):
        out[d.id] = (d, AgentView(
            id=d.id, state=d.state, agent_version=d.agent_version, pause_reason=d.pause_reason,
            holds_shards=d.id in holds,
            upgrading_to=(d.upgrade_to or {}).get("version") if d.upgrade_to else None,
            upgrade_started=d.upgrade_started_at, upgrade_failed=d.upgrade_failed,
            can_upgrade=rollouts.can_self_upgrade(d.capabilities)))
    return out


def upgrade_pass(session: Session, now: dt.datetime, timeout_s: float) -> UpgradePlan:
    row = rollouts.get_rollout(session)
    rollout = Rollout(row.version, row.sha256, row.max_parallel) if row else None
    if rollout is None and not rollouts.upgrades_in_flight(session):
        return UpgradePlan()  # the usual case: no rollout, nothing to close
    devices = agent_views(session)
    plan = plan_upgrades([view for _, view in devices.values()], rollout, now, timeout_s)
    for device_id in plan.done:
        device, view = devices[device_id]
        record(session, "AgentUpgraded", f"agent {view.upgrading_to} runs", now=now,
               device_id=device_id)
        device.upgrade_to = device.upgrade_started_at = None
    for device_id in plan.timed_out:
        device, view = devices[device_id]
        record(session, "AgentUpgradeFailed", f"timed out: no heartbeat with agent "
               f"{view.upgrading_to} within {timeout_s:g} s (still reports "
               f"{view.agent_version})", now=now, device_id=device_id, kind="Warning")
        device.upgrade_failed = view.upgrading_to
        device.upgrade_to = device.upgrade_started_at = None
    for device_id in plan.cancelled:
        device, view = devices[device_id]
        record(session, "AgentUpgradeCancelled", f"agent {view.upgrading_to}: the rollout "
               "changed", now=now, device_id=device_id)
        device.upgrade_to = device.upgrade_started_at = None
    for device_id in plan.start:
        device, view = devices[device_id]
        assert rollout is not None
        record(session, "AgentUpgradeStarted", f"agent {view.agent_version} -> "
               f"{rollout.version}", now=now, device_id=device_id)
        device.upgrade_to = {"version": rollout.version, "sha256": rollout.sha256}
        device.upgrade_started_at = now
    session.flush()
    return plan
