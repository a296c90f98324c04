"""Devices: registration, the heartbeat, reads, and the admin's cordon/uncordon/drain/delete."""

from __future__ import annotations

import datetime as dt
from typing import Any

from fastapi import APIRouter, Query, Request, Response, Security

from api.deps import BEARER, AdminDep, ClockDep, DeviceDep, SessionDep, SettingsDep, UserDep
from api.fast_path import heartbeat_reply
from api.schemas.common import EventRead, Limit, Offset, Page, errors, page_of
from api.schemas.devices import (
    DevicePatch,
    DeviceRead,
    DeviceRegister,
    DeviceRegistered,
    DeviceTokenRotated,
    HeartbeatIn,
    HeartbeatOut,
    LogsIn,
    LogsRead,
    TelemetrySampleRead,
)
from domain.store import devices, events, lifecycle, tokens
from domain.store.selectors import parse_selector

router = APIRouter(prefix="/v1/devices", tags=["devices"], responses=errors(401, 403, 422))


@router.post("/register", status_code=201, response_model=DeviceRegistered)
def register_device(body: DeviceRegister, request: Request, session: SessionDep, settings: SettingsDep,
             clock: ClockDep):
    """Enroll a phone with an enrollment token; the device token is returned only here."""
    with session.begin():
        device, secret = devices.register_device(
            session, enrollment_secret=body.enrollment_token, name=body.name,
            labels=body.labels, spec=body.spec.model_dump(exclude_none=True), now=clock())
    request.app.state.scheduler.device_changed(device.id)
    return {"device_id": device.id, "device_token": secret, "name": device.name,
            "labels": device.labels, "state": device.state,
            "heartbeat_interval_s": settings.heartbeat_interval_s,
            "lease_grace_s": settings.lease_grace_s}


@router.post("/{device_id}/token", response_model=DeviceTokenRotated, responses=errors(409))
def rotate_token(device_id: str, principal: DeviceDep, session: SessionDep,
                 settings: SettingsDep, clock: ClockDep):
    """A device replaces its own token (its heartbeat says when: `rotate_token`), no
    re-enrolment; the token it asked with keeps working for
    `PHALANX_DEVICE_TOKEN_ROTATION_GRACE_S`, then no more. Only the device's newest token
    rotates: one already superseded (in its grace period) gets 409."""
    with session.begin():
        secret, ends = tokens.rotate_device_token(session, principal, clock(),
                                                  settings.device_token_rotation_grace_s)
    return {"device_id": device_id, "device_token": secret, "previous_token_expires_at": ends}


def _inlined(schema: dict[str, Any]) -> dict[str, Any]:
    """A pydantic JSON schema with its `$defs` written in place: a `#/$defs/...` reference
    inside the OpenAPI document resolves against the document's root, where there are none
    (client generators and schemathesis skipped the heartbeat's telemetry for it)."""
    defs = schema.get("$defs", {})

    def walk(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return walk(defs[ref.removeprefix("#/$defs/")])
            return {k: walk(v) for k, v in node.items() if k != "$defs"}
        if isinstance(node, list):
            return [walk(v) for v in node]
        return node

    return walk(schema)


HEARTBEAT_BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": _inlined(HeartbeatIn.model_json_schema())}}}}


@router.post("/{device_id}/heartbeat", response_model=HeartbeatOut, openapi_extra=HEARTBEAT_BODY,
             dependencies=[Security(BEARER)], responses=errors(429))
async def send_heartbeat(device_id: str, request: Request):
    """Renew the lease and store the telemetry (device token); answers after the commit, with
    the device's commands. Served by `api.fast_path.FastPath` ahead of this
    route; this handler runs the same code for anything that reaches the router."""
    reply = await heartbeat_reply(request.app.state, device_id,
                                  request.headers.get("authorization"), await request.body())
    return Response(reply, media_type="application/json")


@router.get("", response_model=Page[DeviceRead])
def list_devices(_: UserDep, session: SessionDep, state: str | None = None,
                 selector: str | None = Query(None, description="labels as Kubernetes writes "
                                              "them: rack=a,zone!=b,gpu in (x,y),!spare"),
                 limit: int = Limit, offset: int = Offset):
    rows = devices.list_devices(session, states=devices.parse_states(state),
                                selector=parse_selector(selector), limit=limit,
                                offset=offset)
    return page_of(list(rows), limit, offset)


@router.get("/{device_id}", response_model=DeviceRead)
def get_device(device_id: str, _: UserDep, session: SessionDep):
    return lifecycle.get_device(session, device_id)


def _admin_change(change, device_id: str, request: Request, session, clock):
    with session.begin():
        device, changed = change(session, device_id, clock())
    if changed:
        request.app.state.scheduler.device_changed(device_id)
    return device


@router.patch("/{device_id}", response_model=DeviceRead)
def patch_device(device_id: str, body: DevicePatch, _: AdminDep, request: Request,
                 session: SessionDep, clock: ClockDep):
    """Set or remove labels (a JSON merge patch: null removes); placement sees them at once."""
    return _admin_change(lambda s, d, now: devices.relabel(s, d, body.labels, now), device_id,
                         request, session, clock)


@router.post("/{device_id}/cordon", response_model=DeviceRead)
def cordon_device(device_id: str, _: AdminDep, request: Request, session: SessionDep, clock: ClockDep):
    """Keep new work off this device."""
    return _admin_change(lifecycle.cordon, device_id, request, session, clock)


@router.post("/{device_id}/uncordon", response_model=DeviceRead)
def uncordon_device(device_id: str, admin: AdminDep, request: Request, session: SessionDep,
             clock: ClockDep):
    """Schedulable again; lifts a quarantine too, with an event naming who."""
    who = admin.name or admin.token_id or "the admin token"
    return _admin_change(lambda s, d, now: lifecycle.uncordon(s, d, now, by=who), device_id,
                         request, session, clock)


@router.post("/{device_id}/drain", response_model=DeviceRead)
def drain_device(device_id: str, _: AdminDep, request: Request, session: SessionDep, clock: ClockDep):
    """Cordon, and tell the agent (next heartbeat) to let go of its work."""
    return _admin_change(lifecycle.drain, device_id, request, session, clock)


@router.delete("/{device_id}", response_model=DeviceRead)
def delete_device(device_id: str, _: AdminDep, request: Request, session: SessionDep,
                  clock: ClockDep):
    """Delete the device and revoke its token (its next request gets 401)."""
    with session.begin():
        device = devices.delete_device(session, device_id, clock())
    request.app.state.authenticator.cache.forget(device_id=device_id)
    request.app.state.scheduler.device_changed(device_id)
    return device


@router.get("/{device_id}/events", response_model=Page[EventRead])
def device_events(device_id: str, _: UserDep, session: SessionDep, limit: int = Limit,
                  offset: int = Offset):
    lifecycle.get_device(session, device_id)
    rows = events.list_events(session, device_id=device_id, limit=limit, offset=offset)
    return page_of(list(rows), limit, offset)


@router.get("/{device_id}/telemetry", response_model=Page[TelemetrySampleRead])
def device_telemetry(device_id: str, _: UserDep, session: SessionDep, since: dt.datetime | None = None,
              limit: int = Query(1000, ge=1, le=10000), offset: int = Offset):
    """Telemetry history (oldest first), from `since` (ISO 8601 or Unix seconds) on."""
    if since is not None and since.tzinfo is None:
        since = since.replace(tzinfo=dt.timezone.utc)
    rows = devices.telemetry_history(session, device_id, since=since, limit=limit, offset=offset)
    return page_of(list(rows), limit, offset)


# -- logs: an operator asks, the agent ships its recent lines with its next heartbeat --------

@router.post("/{device_id}/logs/request", status_code=202, response_model=LogsRead,
             responses=errors(404))
def request_logs(device_id: str, _: AdminDep, session: SessionDep, clock: ClockDep):
    """Ask the device's agent for its recent log lines (it ships them after its next
    heartbeat); read them with GET .../logs once `shipped_at` passes `requested_at`."""
    with session.begin():
        devices.request_logs(session, device_id, clock())
        return devices.read_logs(session, device_id)


@router.get("/{device_id}/logs", response_model=LogsRead, responses=errors(404))
def read_logs(device_id: str, _: AdminDep, session: SessionDep):
    """The lines the agent shipped last, and whether a request is still open."""
    return devices.read_logs(session, device_id)


@router.post("/{device_id}/logs", response_model=LogsRead, responses=errors(404, 413))
def ship_logs(device_id: str, body: LogsIn, _: DeviceDep, session: SessionDep,
              clock: ClockDep):
    """The agent's recent lines (its bounded ring), answering a request (device token)."""
    with session.begin():
        devices.ship_logs(session, device_id, [line.model_dump() for line in body.lines],
                          clock())
        return devices.read_logs(session, device_id)
