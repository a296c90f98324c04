"""Enrollment tokens (to register phones) and user tokens (for people): admin only."""

from __future__ import annotations

from fastapi import APIRouter, Request

from api.auth import expires_in
from api.deps import AdminDep, ClockDep, SessionDep, SettingsDep
from api.schemas.common import Limit, Offset, Page, errors, page_of
from api.schemas.tokens import (
    ApiTokenCreate,
    ApiTokenCreated,
    ApiTokenRead,
    EnrollmentTokenCreate,
    EnrollmentTokenCreated,
    EnrollmentTokenRead,
)
from domain.store import tokens

router = APIRouter(prefix="/v1", tags=["tokens"], responses=errors(401, 403, 422))


@router.post("/enrollment-tokens", status_code=201, response_model=EnrollmentTokenCreated)
def create_enrollment_token(body: EnrollmentTokenCreate, _: AdminDep, session: SessionDep,
                            settings: SettingsDep, clock: ClockDep):
    ttl = body.expires_in_s or settings.enrollment_token_ttl_s
    with session.begin():
        row, secret = tokens.create_enrollment_token(
            session, expires_at=expires_in(clock, ttl), max_uses=body.max_uses,
            labels=body.labels, description=body.description)
    return {**EnrollmentTokenRead.model_validate(row).model_dump(), "token": secret}


@router.get("/enrollment-tokens", response_model=Page[EnrollmentTokenRead])
def list_enrollment_tokens(_: AdminDep, session: SessionDep, limit: int = Limit,
                           offset: int = Offset):
    return page_of(list(tokens.list_enrollment_tokens(session, limit, offset)), limit, offset)


@router.delete("/enrollment-tokens/{token_id}", response_model=EnrollmentTokenRead)
def revoke_enrollment_token(token_id: str, _: AdminDep, session: SessionDep):
    with session.begin():
        return tokens.revoke_enrollment_token(session, token_id)


@router.post("/tokens", status_code=201, response_model=ApiTokenCreated)
def create_user_token(body: ApiTokenCreate, _: AdminDep, session: SessionDep, clock: ClockDep):
    with session.begin():
        row, secret = tokens.create_api_token(
            session, kind="user", name=body.name, expires_at=expires_in(clock, body.expires_in_s))
    return {**ApiTokenRead.model_validate(row).model_dump(), "token": secret}


@router.get("/tokens", response_model=Page[ApiTokenRead])
def list_tokens(_: AdminDep, session: SessionDep, kind: str | None = None, limit: int = Limit,
                offset: int = Offset):
    return page_of(list(tokens.list_api_tokens(session, limit, offset, kind)), limit, offset)


@router.delete("/tokens/{token_id}", response_model=ApiTokenRead)
def revoke_token(token_id: str, _: AdminDep, session: SessionDep, request: Request):
    with session.begin():
        row = tokens.revoke_api_token(session, token_id)
    request.app.state.authenticator.cache.forget(token_id=token_id)
    return row
