"""/v1/agent/rollout: which agent build the phones should run (admin), and the phones' reports
when they cannot install it (device token)."""

from __future__ import annotations

from fastapi import APIRouter

from api import agent_dist
from api.deps import AdminDep, ClockDep, DeviceDep, SessionDep, UserDep
from api.errors import Conflict
from api.schemas.common import errors
from api.schemas.devices import DeviceRead
from api.schemas.rollouts import RolloutIn, RolloutRead, UpgradeReportIn
from api.store import rollouts

router = APIRouter(prefix="/v1", tags=["agent"], responses=errors(401, 403, 422))


def _read(session, served: tuple[str, str]) -> dict:
    row = rollouts.get_rollout(session)
    out = {"active": row is not None, "served": {"version": served[0], "sha256": served[1]},
           "devices": rollouts.rollout_devices(session, row),
           "versions": rollouts.version_counts(session)}
    if row is not None:
        out.update(version=row.version, sha256=row.sha256, max_parallel=row.max_parallel,
                   set_by=row.set_by, updated=row.updated)
    return out


@router.get("/agent/rollout", response_model=RolloutRead)
def get_rollout(_: UserDep, session: SessionDep):
    """The rollout in force (if any), how far it is, and the agent build this replica serves."""
    return _read(session, agent_dist.served_build())


@router.put("/agent/rollout", response_model=RolloutRead, responses=errors(409))
def set_rollout(body: RolloutIn, principal: AdminDep, session: SessionDep, clock: ClockDep):
    """Roll this server's agent build out to every phone, `max_parallel` at a time, each between
    jobs. Phones install it only if the archive's SHA-256 is the one pinned here."""
    version, sha256 = agent_dist.served_build()
    if body.version is not None and body.version != version:
        raise Conflict(f"this server serves agent {version}, not {body.version}: run a server "
                       f"of the version you want to roll out (phones download it from here)")
    with session.begin():
        rollouts.set_rollout(session, version=version, sha256=sha256,
                             max_parallel=body.max_parallel,
                             set_by=principal.name or principal.kind, now=clock())
    return _read(session, (version, sha256))


@router.delete("/agent/rollout", response_model=RolloutRead)
def stop_rollout(_: AdminDep, session: SessionDep, clock: ClockDep):
    """Stop the rollout: no phone starts an upgrade. Phones already installing finish."""
    with session.begin():
        rollouts.stop_rollout(session, clock())
    return _read(session, agent_dist.served_build())


@router.post("/devices/{device_id}/upgrade-report", response_model=DeviceRead,
             responses=errors(404))
def report_upgrade(device_id: str, body: UpgradeReportIn, _: DeviceDep, session: SessionDep,
                   clock: ClockDep):
    """The agent could not install a build, or its new agent would not start and was rolled
    back (device token): the upgrade ends and is not asked of this phone again."""
    with session.begin():
        return rollouts.report_failure(session, device_id, body.version, body.outcome,
                                       body.detail, clock())
