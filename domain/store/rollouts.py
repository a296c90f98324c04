"""Agent rollouts in the store: the build phones should run, and what phones report back.

The rollout row says which build (version + the sha256 of the archive the servers serve) and
how many phones may upgrade at once; the scheduler's pass (scheduler.tasks.upgrades) tells idle
phones to install it, a few at a time (scheduler.policy.upgrades).
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from sqlalchemy import func, select, update
from sqlalchemy.orm import Session

from domain.errors import Invalid
from domain.store.devices import get_device
from domain.store.events import record
from domain.store.models import AgentRollout, Device

ROLLOUT_ID = 1
SELF_UPGRADE = "self_upgrade"  # the capability of an agent started by launch.sh (agent/slots.py)


def can_self_upgrade(capabilities: dict[str, Any] | None) -> bool:
    """Whether the agent can install a rollout and roll it back: only those are asked."""
    features = capabilities.get("features") if isinstance(capabilities, dict) else None
    return isinstance(features, list) and SELF_UPGRADE in features  # stored: any JSON


def get_rollout(session: Session) -> AgentRollout | None:
    return session.get(AgentRollout, ROLLOUT_ID)


def set_rollout(session: Session, *, version: str, sha256: str, max_parallel: int,
                set_by: str | None, now: dt.datetime) -> AgentRollout:
    """Start (or change) the rollout of this build."""
    row = session.get(AgentRollout, ROLLOUT_ID, with_for_update=True)
    if row is None:
        row = AgentRollout(id=ROLLOUT_ID, version=version, sha256=sha256,
                           max_parallel=max_parallel, set_by=set_by)
        session.add(row)
    else:
        row.version, row.sha256, row.max_parallel, row.set_by = \
            version, sha256, max_parallel, set_by
    # a rollout set again retries the phones that failed (one offline past the timeout)
    retried = session.execute(update(Device).where(Device.upgrade_failed.is_not(None))
                              .values(upgrade_failed=None)).rowcount
    record(session, "RolloutStarted", f"agent {version} ({sha256[:12]}), at most "
           f"{max_parallel} phone(s) at a time" + (f"; retrying {retried} that failed"
                                                   if retried else ""), now=now)
    session.flush()
    return row


def stop_rollout(session: Session, now: dt.datetime) -> bool:
    """End the rollout: no phone starts an upgrade; those told to upgrade are told no more."""
    row = session.get(AgentRollout, ROLLOUT_ID, with_for_update=True)
    if row is None:
        return False
    record(session, "RolloutStopped", f"agent {row.version}: rollout stopped", now=now)
    session.delete(row)
    session.flush()
    return True


def upgrades_in_flight(session: Session) -> int:
    return int(session.scalar(select(func.count()).select_from(Device)
                              .where(Device.upgrade_started_at.is_not(None))) or 0)


def version_counts(session: Session) -> dict[str, int]:
    """agent version -> devices reporting it ("unknown": never heartbeated)."""
    rows = session.execute(select(Device.agent_version, func.count()).group_by(Device.agent_version))
    return {version or "unknown": int(n) for version, n in rows}


def rollout_devices(session: Session, rollout: AgentRollout | None) -> dict[str, Any]:
    """How far a rollout is: devices on its version, upgrading, failed, still to do."""
    rows = session.execute(select(Device.agent_version, Device.upgrade_to, Device.upgrade_failed,
                                  Device.capabilities))
    out = {"up_to_date": 0, "upgrading": 0, "failed": 0, "waiting": 0, "cannot": 0}
    for agent_version, upgrade_to, failed, caps in rows:
        if rollout is None:
            continue
        if agent_version == rollout.version:
            out["up_to_date"] += 1
        elif upgrade_to:
            out["upgrading"] += 1
        elif failed == rollout.version:
            out["failed"] += 1
        elif not can_self_upgrade(caps):
            out["cannot"] += 1
        else:
            out["waiting"] += 1
    return out


def report_failure(session: Session, device_id: str, version: str, outcome: str, detail: str,
                   now: dt.datetime) -> Device:
    """The agent could not install `version` (or the new agent would not start and was rolled
    back): the upgrade ends, and this version is not asked of this phone again."""
    device = get_device(session, device_id, for_update=True)
    if not version:
        raise Invalid("version", "the agent version that failed")
    if (device.upgrade_to or {}).get("version") == version:  # a late report ends nothing else
        device.upgrade_to, device.upgrade_started_at = None, None
    device.upgrade_failed = version
    record(session, "AgentUpgradeFailed", f"{outcome}: agent {version}: {detail}", now=now,
           device_id=device_id, kind="Warning")
    session.flush()
    return device
