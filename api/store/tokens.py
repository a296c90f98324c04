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

from api.errors import Forbidden, NotFound, Unauthorized
from api.store.models import ApiToken, EnrollmentToken

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
    requests in flight still land), or at its earlier end. The new secret is returned once."""
    old = session.get(ApiToken, principal.token_id, with_for_update=True)
    if old is None or old.kind != "device" or old.device_id != principal.device_id:
        raise Forbidden("only a device's own token can be rotated by the device")
    # checked on the row itself, not a cache: a revoked or ended token mints nothing
    if old.revoked:
        raise Unauthorized("bearer token revoked")
    if old.expires_at is not None and old.expires_at <= now:
        raise Unauthorized("bearer token expired")
    ends = now + dt.timedelta(seconds=grace_s)
    # every token of the device gets an end, the one asking too: the new token is then the
    # device's only open one (a successor whose answer was lost does not live on)
    others = session.scalars(select(ApiToken).where(
        ApiToken.device_id == old.device_id, ApiToken.kind == "device",
        ApiToken.revoked.is_(False)).with_for_update())
    for token in others:
        if token.expires_at is None or token.expires_at > ends:
            token.expires_at = ends
    _, secret = create_api_token(session, kind="device", name=old.name, device_id=old.device_id,
                                 now=now)
    return secret, old.expires_at or ends


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
