"""/v1/agent/rollout: which agent build the phones should run (admin), and the phones' reports
when they cannot install it (device token)."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel, Field

from agent import release
from api import agent_dist
from api.deps import AdminDep, ClockDep, DeviceDep, SessionDep, SettingsDep, UserDep
from api.schemas.common import errors
from api.schemas.devices import DeviceRead
from api.schemas.rollouts import RolloutIn, RolloutRead, UpgradeReportIn
from domain.errors import Conflict
from domain.store import rollouts

router = APIRouter(prefix="/v1", tags=["agent"], responses=errors(401, 403, 422))


class ReleaseKeyRead(BaseModel):
    algorithm: str = Field(description="ed25519")
    public_key: str = Field(description="hex: the key phones check agent upgrades against")
    fingerprint: str = Field(description="the first 16 hex digits of the key's sha256, as "
                             "agents log it")


def _served(settings) -> tuple[str, str]:
    build = agent_dist.served(settings.data_dir)
    return build.version, build.sha256


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
def get_rollout(_: UserDep, session: SessionDep, settings: SettingsDep):
    """The rollout in force (if any), how far it is, and the agent build this replica serves."""
    return _read(session, _served(settings))


@router.get("/agent/release-key", response_model=ReleaseKeyRead)
def get_release_key(_: UserDep, settings: SettingsDep):
    """The public key this server signs agent builds with (docs/agent.md, "Upgrades"): the one
    inside the archive it serves, to pin on a phone installed otherwise."""
    public = bytes.fromhex(agent_dist.served(settings.data_dir).public_key)
    return {"algorithm": release.ALGORITHM, "public_key": public.hex(),
            "fingerprint": release.fingerprint(public)}


@router.put("/agent/rollout", response_model=RolloutRead, responses=errors(409))
def set_rollout(body: RolloutIn, principal: AdminDep, session: SessionDep, clock: ClockDep,
                settings: SettingsDep):
    """Roll this server's agent build out to every phone, `max_parallel` at a time, each between
    jobs. Phones install it only if the archive's SHA-256 is the one pinned here and it is
    signed by a release key they trust."""
    version, sha256 = _served(settings)
    if body.version is not None and body.version != version:
        raise Conflict(f"this server serves agent {version}, not {body.version}: run a server "
                       f"of the version you want to roll out (phones download it from here)")
    with session.begin():
        rollouts.set_rollout(session, version=version, sha256=sha256,
                             max_parallel=body.max_parallel,
                             set_by=principal.name or principal.kind, now=clock())
    return _read(session, (version, sha256))


@router.delete("/agent/rollout", response_model=RolloutRead)
def stop_rollout(_: AdminDep, session: SessionDep, clock: ClockDep, settings: SettingsDep):
    """Stop the rollout: no phone starts an upgrade. Phones already installing finish."""
    with session.begin():
        rollouts.stop_rollout(session, clock())
    return _read(session, _served(settings))


@router.post("/devices/{device_id}/upgrade-report", response_model=DeviceRead,
             responses=errors(404))
def report_upgrade(device_id: str, body: UpgradeReportIn, _: DeviceDep, session: SessionDep,
                   clock: ClockDep):
    """The agent could not install a build, or its new agent would not start and was rolled
    back (device token): the upgrade ends and is not asked of this phone again."""
    with session.begin():
        return rollouts.report_failure(session, device_id, body.version, body.outcome,
                                       body.detail, clock())
