"""FastAPI dependencies: `Annotated` aliases keep handler signatures short."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterator
from typing import Annotated

from fastapi import Depends, Request, Security
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from api.auth import Authenticator, parse_bearer
from domain.errors import Forbidden
from domain.settings import Settings
from domain.store.tokens import Principal


def get_session(request: Request) -> Iterator[Session]:
    """One session per request; the route owns the transaction (commit or roll back)."""
    with request.app.state.session_factory() as session:
        yield session


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_clock(request: Request) -> Callable[[], dt.datetime]:
    return request.app.state.clock


# declares `Authorization: Bearer <token>` in the OpenAPI document (/docs gets an Authorize
# button); the token itself is checked by `principal_for`, with the answers this API documents
BEARER = HTTPBearer(auto_error=False, scheme_name="bearer",
                    description="an admin, user or device token (phx-adm-, phx-usr-, phx-dev-)")
Bearer = Annotated[HTTPAuthorizationCredentials | None, Security(BEARER)]


async def get_principal(request: Request, _: Bearer) -> Principal:
    """Any valid token. Async so a cache hit costs no thread hop (the heartbeat hot path)."""
    return await principal_for(request.app.state.authenticator,
                               request.headers.get("authorization"))


async def principal_for(auth: Authenticator, authorization: str | None) -> Principal:
    """The principal of an Authorization header (401 unless a valid bearer token), from the
    cache when it holds the token, else from the database on a worker thread."""
    token_hash, principal = auth.cached(parse_bearer(authorization))
    if principal is None:
        principal = await run_in_threadpool(auth.lookup, token_hash)
    return principal


def _path_device_id(request: Request) -> str | None:
    params = request.path_params
    if "device_id" in params:
        return params["device_id"]
    if request.url.path.startswith("/v1/devices/"):
        return params.get("id")
    return None


async def require_admin(principal: Annotated[Principal, Depends(get_principal)]) -> Principal:
    if principal.kind != "admin":
        raise Forbidden(f"this needs an admin token, not a {principal.kind} token")
    return principal


async def require_user(principal: Annotated[Principal, Depends(get_principal)]) -> Principal:
    if principal.kind not in ("admin", "user"):
        raise Forbidden(f"this needs a user or admin token, not a {principal.kind} token")
    return principal


async def require_device(
    request: Request, principal: Annotated[Principal, Depends(get_principal)]
) -> Principal:
    """A device token; when the path names a device, it must be this token's device."""
    return check_device(principal, _path_device_id(request))


def check_device(principal: Principal, wanted: str | None) -> Principal:
    """The device-token rule without a Request (the heartbeat's fast path uses it too)."""
    if principal.kind != "device":
        raise Forbidden(f"this needs a device token, not a {principal.kind} token")
    if wanted is not None and wanted != principal.device_id:
        raise Forbidden("a device token may act only for its own device")
    return principal


SessionDep = Annotated[Session, Depends(get_session)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
ClockDep = Annotated[Callable[[], dt.datetime], Depends(get_clock)]
PrincipalDep = Annotated[Principal, Depends(get_principal)]
AdminDep = Annotated[Principal, Depends(require_admin)]
UserDep = Annotated[Principal, Depends(require_user)]
DeviceDep = Annotated[Principal, Depends(require_device)]
