"""Enrollment tokens and API tokens (admin, user, device): only hashes are stored."""

from __future__ import annotations

import datetime as dt
import hashlib
import secrets
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from domain.errors import Conflict, Forbidden, NotFound, Unauthorized
from domain.store.models import ApiToken, EnrollmentToken

PREFIXES = {"admin": "phx-adm-", "user": "phx-usr-", "device": "phx-dev-", "enrollment": "phx-enr-"}


def hash_token(secret: str) -> str:
    return hashlib.sha256(secret.encode("utf-8")).hexdigest()


def new_secret(kind: str) -> str:
    return PREFIXES[kind] + secrets.token_urlsafe(32)


@dataclass(frozen=True)
class Principal:
    kind: str  # admin | user | device
    token_id: str | None = None
    device_id: str | None = None
    name: str | None = None

    @property
    def is_admin(self) -> bool:
        return self.kind == "admin"

    @property
    def user(self) -> str | None:
        """The tenant this principal acts for: a user token is one user (its id: names are free
        text, and two tokens named alike must not share jobs); None for an admin."""
        return self.token_id if self.kind == "user" else None


def create_enrollment_token(session: Session, *, expires_at: dt.datetime, max_uses: int | None,
                            labels: dict[str, str], description: str | None
                            ) -> tuple[EnrollmentToken, str]:
    secret = new_secret("enrollment")
    row = EnrollmentToken(token_hash=hash_token(secret), expires_at=expires_at, max_uses=max_uses,
                          labels=labels, description=description, uses=0, revoked=False)
    session.add(row)
    session.flush()
    return row, secret


def list_enrollment_tokens(session: Session, limit: int, offset: int) -> Sequence[EnrollmentToken]:
    query = select(EnrollmentToken).order_by(EnrollmentToken.created, EnrollmentToken.id)
    return session.scalars(query.limit(limit + 1).offset(offset)).all()


def revoke_enrollment_token(session: Session, token_id: str) -> EnrollmentToken:
    row = session.get(EnrollmentToken, token_id)
    if row is None:
        raise NotFound(f"enrollment token {token_id} not found")
    row.revoked = True
    session.flush()
    return row


def use_enrollment_token(session: Session, secret: str, now: dt.datetime) -> EnrollmentToken:
    """Count one use atomically (a guarded UPDATE), or say exactly why the token is refused."""
    token_hash = hash_token(secret)
    row = session.scalars(
        select(EnrollmentToken).where(EnrollmentToken.token_hash == token_hash)
    ).first()
    if row is None:
        raise Unauthorized("invalid enrollment token")
    if row.revoked:
        raise Forbidden("enrollment token revoked")
    if row.expires_at <= now:
        raise Forbidden(f"enrollment token expired at {row.expires_at.isoformat()}")
    guard = update(EnrollmentToken).where(
        EnrollmentToken.id == row.id, EnrollmentToken.revoked.is_(False),
        EnrollmentToken.expires_at > now,
    )
    if row.max_uses is not None:
        guard = guard.where(EnrollmentToken.uses < EnrollmentToken.max_uses)
    result = session.execute(guard.values(uses=EnrollmentToken.uses + 1),
                             execution_options={"synchronize_session": False})
    if result.rowcount != 1:  # type: ignore[attr-defined]
        raise Forbidden(f"enrollment token used up ({row.max_uses} uses)")
    session.refresh(row)
    return row


def create_api_token(session: Session, *, kind: str, name: str | None,
                     device_id: str | None = None, expires_at: dt.datetime | None = None,
                     now: dt.datetime | None = None) -> tuple[ApiToken, str]:
    """`now`: the app's clock, which a device token's age (rotation) is measured by."""
    secret = new_secret(kind)
    row = ApiToken(kind=kind, name=name, token_hash=hash_token(secret), device_id=device_id,
                   expires_at=expires_at, revoked=False, **({"created": now} if now else {}))
    session.add(row)
    session.flush()
    return row, secret


def rotate_device_token(session: Session, principal: Principal, now: dt.datetime,
                        grace_s: float) -> tuple[str, dt.datetime]:
    """A new token for the asking device; the one it asked with ends after `grace_s` (its
    requests in flight still land), or at its earlier end. The new secret is returned once.

    Only the device's one open token (no end yet) may rotate. A superseded token (one a
    rotation gave an end) still authenticates the device's ordinary calls until that end, so
    a phone whose rotation answer was lost keeps working through the grace, but it can never
    rotate again: `Conflict` (409). Otherwise whoever kept an old token could mint a fresh
    one with no end and end the phone's (issue 42, item 7)."""
    old = session.get(ApiToken, principal.token_id)
    if old is None or old.kind != "device" or old.device_id != principal.device_id:
        raise Forbidden("only a device's own token can be rotated by the device")
    ends = now + dt.timedelta(seconds=grace_s)
    # the asking token gets its end in one guarded UPDATE: of two rotations with one token
    # (two requests at once, or a phone and whoever copied its token), exactly one wins, on
    # Postgres and on SQLite alike; the row is judged as it is now, not as a cache saw it
    won = session.execute(
        update(ApiToken).where(ApiToken.id == old.id, ApiToken.revoked.is_(False),
                               ApiToken.expires_at.is_(None))
        .values(expires_at=ends), execution_options={"synchronize_session": False})
    if won.rowcount != 1:  # type: ignore[attr-defined]
        session.refresh(old)
        raise _not_rotatable(old, now)
    # every other token of the device ends too (never later than it already would): the new
    # token is then the device's only open one
    session.execute(
        update(ApiToken).where(ApiToken.device_id == old.device_id, ApiToken.kind == "device",
                               ApiToken.id != old.id, ApiToken.revoked.is_(False),
                               (ApiToken.expires_at.is_(None)) | (ApiToken.expires_at > ends))
        .values(expires_at=ends), execution_options={"synchronize_session": False})
    _, secret = create_api_token(session, kind="device", name=old.name, device_id=old.device_id,
                                 now=now)
    return secret, ends


def _not_rotatable(token: ApiToken, now: dt.datetime) -> Exception:
    """Why a device token that did not get its end from this rotation cannot rotate."""
    if token.revoked:
        return Unauthorized("bearer token revoked")
    if token.expires_at is not None and token.expires_at <= now:
        return Unauthorized("bearer token expired")
    return Conflict(
        "this device token was superseded by a rotation: it works for the device's calls "
        f"until {token.expires_at.isoformat() if token.expires_at else 'its end'}, but only "
        "the newest token may rotate. Use the token the rotation answered with; a phone that "
        "lost it must be enrolled again")


def list_api_tokens(session: Session, limit: int, offset: int,
                    kind: str | None = None) -> Sequence[ApiToken]:
    query = select(ApiToken).order_by(ApiToken.created, ApiToken.id)
    if kind:
        query = query.where(ApiToken.kind == kind)
    return session.scalars(query.limit(limit + 1).offset(offset)).all()


def revoke_api_token(session: Session, token_id: str) -> ApiToken:
    row = session.get(ApiToken, token_id)
    if row is None:
        raise NotFound(f"token {token_id} not found")
    row.revoked = True
    session.flush()
    return row


def revoke_device_tokens(session: Session, device_id: str) -> list[Any]:
    result = session.execute(
        update(ApiToken).where(ApiToken.device_id == device_id).values(revoked=True)
        .returning(ApiToken.id)
    )
    return list(result.scalars())
