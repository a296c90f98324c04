"""Enrollment tokens and user tokens."""

from __future__ import annotations

import datetime as dt

from pydantic import Field

from api.schemas.common import Labels, ReadModel, RequestModel


class EnrollmentTokenCreate(RequestModel):
    expires_in_s: float | None = Field(default=None, gt=0, le=365 * 24 * 3600.0,
                                       description="default: the server's enrollment_token_ttl_s")
    max_uses: int | None = Field(default=None, ge=1, le=1_000_000, description="null: unlimited")
    labels: Labels = Field(default_factory=dict, description="labels every enrolled device gets")
    description: str | None = Field(default=None, max_length=200)


class EnrollmentTokenRead(ReadModel):
    id: str
    expires_at: dt.datetime
    max_uses: int | None
    uses: int
    revoked: bool
    labels: dict[str, str]
    description: str | None
    created: dt.datetime


class EnrollmentTokenCreated(EnrollmentTokenRead):
    token: str = Field(description="the secret; shown only here, stored hashed")


class ApiTokenCreate(RequestModel):
    name: str = Field(min_length=1, max_length=200)
    expires_in_s: float | None = Field(default=None, gt=0, le=10 * 365 * 24 * 3600.0)


class ApiTokenRead(ReadModel):
    id: str
    kind: str
    name: str | None
    device_id: str | None
    revoked: bool
    expires_at: dt.datetime | None
    created: dt.datetime


class ApiTokenCreated(ApiTokenRead):
    token: str = Field(description="the secret; shown only here, stored hashed")
