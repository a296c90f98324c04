"""Node lifecycle, Kubernetes-style: lease expiry, cordon, uncordon, drain.

A device's shown `state` is derived from two facts: is its lease fresh, and what the admin set
(`cordoned`, `draining`). NotReady wins over the admin flags; Draining implies cordoned. Every
change of `state` (or of the flags) records an Event. Functions take a Session and flush; the
caller owns the transaction. "now" is always passed in, so tests control the clock.
"""

from __future__ import annotations

import datetime as dt

from sqlalchemy import case, select, update
from sqlalchemy.orm import Session

from domain.errors import NotFound
from domain.store import events
from domain.store.models import Device
from wire.states import DEVICE_STATES, DeviceState

READY, NOT_READY = DeviceState.READY.value, DeviceState.NOT_READY.value
CORDONED, DRAINING = DeviceState.CORDONED.value, DeviceState.DRAINING.value
STATES = DEVICE_STATES


def derive_state(lease_fresh: bool, cordoned: bool, draining: bool) -> str:
    if not lease_fresh:
        return NOT_READY
    if draining:
        return DRAINING
    return CORDONED if cordoned else READY


def leased_state_sql():
    """The state of a device that just renewed its lease, computed from the row being updated
    (so a cordon committed a moment earlier is never overwritten)."""
    return case((Device.draining.is_(True), DRAINING), (Device.cordoned.is_(True), CORDONED),
                else_=READY)


def get_device(session: Session, device_id: str, *, for_update: bool = False) -> Device:
    query = select(Device).where(Device.id == device_id)
    if for_update:
        query = query.with_for_update()
    device = session.scalars(query).first()
    if device is None:
        raise NotFound(f"device {device_id} not found")
    return device


def _set_flags(session: Session, device: Device, now: dt.datetime, *, cordoned: bool,
               draining: bool, reason: str, message: str) -> bool:
    """Apply admin flags; record an event only when something changed. Returns changed."""
    if device.cordoned == cordoned and device.draining == draining:
        return False
    device.cordoned, device.draining = cordoned, draining
    device.state = derive_state(device.state != NOT_READY, cordoned, draining)
    events.record(session, reason, message, now=now, device_id=device.id)
    session.flush()
    return True


def cordon(session: Session, device_id: str, now: dt.datetime) -> tuple[Device, bool]:
    device = get_device(session, device_id, for_update=True)
    changed = _set_flags(session, device, now, cordoned=True, draining=device.draining,
                         reason=DeviceState.CORDONED.value, message="cordoned: no new work is placed here")
    return device, changed


def uncordon(session: Session, device_id: str, now: dt.datetime,
             by: str | None = None) -> tuple[Device, bool]:
    """Schedulable again; a quarantine (an audit found its result wrong) is lifted with it,
    and an event says by whom (`by`: the admin token's name or id)."""
    device = get_device(session, device_id, for_update=True)
    was = device.quarantine_reason
    if was is not None:
        device.quarantine_reason = None
        events.record(session, "QuarantineLifted",
                      f"quarantine lifted by {by or 'an admin'} (it was: {was})", now=now,
                      device_id=device.id, data={"by": by, "was": was})
    changed = _set_flags(session, device, now, cordoned=False, draining=False,
                         reason="Uncordoned", message="uncordoned: schedulable again")
    return device, changed or was is not None


def quarantine(session: Session, device_id: str, reason: str, now: dt.datetime,
               job_id: str | None = None, data: dict | None = None) -> bool:
    """Cordon a device whose result an audit found wrong (scheduler.audits), with the reason
    kept on it until an admin uncordons it; False when it is gone or already quarantined."""
    device = session.scalars(select(Device).where(Device.id == device_id)
                             .with_for_update()).first()
    if device is None or device.quarantine_reason is not None:
        return False
    device.quarantine_reason = reason
    events.record(session, "Quarantined", reason, now=now, device_id=device_id, job_id=job_id,
                  kind="Warning", data=data)
    _set_flags(session, device, now, cordoned=True, draining=device.draining,
               reason=DeviceState.CORDONED.value,
               message="cordoned: quarantined (phalanx devices uncordon lifts it)")
    session.flush()
    return True


def drain(session: Session, device_id: str, now: dt.datetime) -> tuple[Device, bool]:
    device = get_device(session, device_id, for_update=True)
    changed = _set_flags(session, device, now, cordoned=True, draining=True, reason=DeviceState.DRAINING.value,
                         message="draining: cordoned, and asked to let go of its work")
    return device, changed


def mark_stale_devices(session: Session, now: dt.datetime, grace: float) -> list[str]:
    """Mark NotReady every device whose lease is older than `grace` seconds; return their ids.

    Level-triggered and idempotent: a second call with the same `now` changes nothing. The
    guarded UPDATE re-checks the lease on the row itself, so a heartbeat that commits first wins.
    """
    cutoff = now - dt.timedelta(seconds=grace)
    stale = (Device.state != NOT_READY) & (
        (Device.lease_renewed_at < cutoff) | Device.lease_renewed_at.is_(None)
    )
    result = session.execute(
        update(Device).where(stale).values(state=NOT_READY, updated=now).returning(Device.id),
        execution_options={"synchronize_session": False},
    )
    ids = sorted(result.scalars())
    for device_id in ids:
        events.record(session, "NodeNotReady", f"no heartbeat for more than {grace:g} s",
                      now=now, device_id=device_id, kind="Warning")
    session.flush()
    return ids
