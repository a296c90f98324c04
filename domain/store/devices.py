"""Device rows: registration, listing with filters, deletion, telemetry history and pruning."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

from sqlalchemy import delete, select
from sqlalchemy.orm import Session

from domain.errors import Invalid
from domain.store import events, tokens
from domain.store.lifecycle import READY, STATES, get_device
from domain.store.models import Device, DeviceLog, TelemetrySample
from domain.store.selectors import Requirement, sql_conditions


def register_device(session: Session, *, enrollment_secret: str, name: str,
                    labels: dict[str, str], spec: dict[str, Any], now: dt.datetime
                    ) -> tuple[Device, str]:
    """Use one enrollment, create the device (leased from now) and its token. The enrollment
    token's labels are the admin's word and win over the device's own; a device that asked
    for another value of one of them is recorded in the Registered event."""
    enrollment = tokens.use_enrollment_token(session, enrollment_secret, now)
    overridden = {k: v for k, v in labels.items()
                  if k in enrollment.labels and enrollment.labels[k] != v}
    device = Device(name=name, labels={**labels, **enrollment.labels}, spec=spec, state=READY,
                    cordoned=False, draining=False, lease_renewed_at=now, capabilities={},
                    profiles={}, latest_telemetry={})
    session.add(device)
    session.flush()
    _, secret = tokens.create_api_token(session, kind="device", name=name, device_id=device.id,
                                        now=now)
    message = f"enrolled as {name!r} with {enrollment.id}"
    if overridden:
        message += "; the enrollment token's labels kept over the device's " + ", ".join(
            f"{k}={v!r} (asked {overridden[k]!r})" for k, v in sorted(
                (k, enrollment.labels[k]) for k in overridden))
    events.record(session, "Registered", message, now=now, device_id=device.id,
                  kind="Warning" if overridden else "Normal",
                  data={"labels_refused": overridden} if overridden else None)
    return device, secret


def parse_states(state: str | None) -> list[str]:
    if not state:
        return []
    states = [s.strip() for s in state.split(",") if s.strip()]
    for value in states:
        if value not in STATES:
            raise Invalid("state", f"unknown state {value!r}; one of {', '.join(STATES)}",
                          where="query")
    return states


def list_devices(session: Session, *, states: list[str], selector: list[Requirement],
                 limit: int, offset: int) -> Sequence[Device]:
    """One query, whatever the page size (no N+1); `limit + 1` rows say if a next page exists."""
    query = select(Device).order_by(Device.created, Device.id)
    if states:
        query = query.where(Device.state.in_(states))
    for condition in sql_conditions(selector, Device.labels):
        query = query.where(condition)
    return session.scalars(query.limit(limit + 1).offset(offset)).all()


MAX_LABELS = 64  # as api.schemas.common.check_labels allows in one request


def relabel(session: Session, device_id: str, patch: dict[str, str | None],
            now: dt.datetime) -> tuple[Device, bool]:
    """Apply a merge patch to the labels (None removes one); an event says what changed."""
    device = get_device(session, device_id, for_update=True)
    before = dict(device.labels or {})
    labels = {**before, **{k: v for k, v in patch.items() if v is not None}}
    for key in (k for k, v in patch.items() if v is None):
        labels.pop(key, None)
    if len(labels) > MAX_LABELS:
        raise Invalid("labels", f"a device has at most {MAX_LABELS} labels, this would make "
                      f"{len(labels)}")
    changes = [f"{k}={labels[k]}" if k in labels else f"{k}-"
               for k in sorted(before.keys() | labels.keys()) if before.get(k) != labels.get(k)]
    if changes:
        device.labels = labels
        events.record(session, "Relabeled", ", ".join(changes), now=now, device_id=device_id,
                      data={"labels": labels})
        session.flush()
    return device, bool(changes)


def delete_device(session: Session, device_id: str, now: dt.datetime) -> Device:
    """Revoke the device's tokens, then delete it (its assignments and samples cascade)."""
    device = get_device(session, device_id, for_update=True)
    tokens.revoke_device_tokens(session, device_id)
    events.record(session, "Deleted", f"device {device.name!r} deleted; its token is revoked",
                  now=now, device_id=device_id, kind="Warning")
    session.delete(device)
    session.flush()
    return device


def telemetry_history(session: Session, device_id: str, *, since: dt.datetime | None,
                      limit: int, offset: int) -> Sequence[TelemetrySample]:
    get_device(session, device_id)
    query = select(TelemetrySample).where(TelemetrySample.device_id == device_id)
    if since is not None:
        query = query.where(TelemetrySample.ts >= since)
    query = query.order_by(TelemetrySample.ts, TelemetrySample.id)
    return session.scalars(query.limit(limit + 1).offset(offset)).all()


def prune_telemetry(session: Session, older_than: dt.datetime) -> int:
    """Delete history samples older than `older_than` (the latest stays on the device row)."""
    result = session.execute(delete(TelemetrySample).where(TelemetrySample.ts < older_than))
    return int(result.rowcount or 0)  # type: ignore[attr-defined]


def request_logs(session: Session, device_id: str, now: dt.datetime) -> Device:
    """Ask the agent for its recent log lines: its heartbeats carry `logs` until it ships them."""
    device = get_device(session, device_id, for_update=True)
    device.logs_requested_at = now
    session.flush()
    return device


def ship_logs(session: Session, device_id: str, lines: list[dict[str, Any]],
              now: dt.datetime) -> DeviceLog:
    """Keep the lines the agent shipped (replacing the last shipment) and end the request."""
    device = get_device(session, device_id, for_update=True)
    row = session.get(DeviceLog, device_id)
    if row is None:
        row = DeviceLog(device_id=device_id, shipped_at=now, lines=lines)
        session.add(row)
    else:
        row.shipped_at, row.lines = now, lines
    device.logs_requested_at = None
    session.flush()
    return row


def read_logs(session: Session, device_id: str) -> dict[str, Any]:
    device = get_device(session, device_id)
    row = session.get(DeviceLog, device_id)
    return {"device_id": device_id, "requested_at": device.logs_requested_at,
            "shipped_at": row.shipped_at if row else None, "lines": row.lines if row else []}


def names_of(session: Session, device_ids: set[str]) -> dict[str, str]:
    """device id -> name, for these ids only."""
    if not device_ids:
        return {}
    rows = session.execute(select(Device.id, Device.name).where(Device.id.in_(sorted(device_ids))))
    return {device_id: name for device_id, name in rows}
