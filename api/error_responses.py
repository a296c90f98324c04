"""How an exception becomes an HTTP error: status, `detail` and extra headers. One mapping for
the app's exception handlers (`api.main`) and the heartbeat's fast path, which runs outside
them (`api.fast_path`)."""

from __future__ import annotations

import logging
import math
from typing import Any

import psycopg
from fastapi.exceptions import RequestValidationError
from sqlalchemy.exc import IntegrityError, OperationalError
from starlette.exceptions import HTTPException

from domain.errors import (
    Conflict,
    DomainError,
    Forbidden,
    NotFound,
    PayloadTooLarge,
    TooManyRequests,
    Unauthorized,
    Unavailable,
    Unprocessable,
)

log = logging.getLogger(__name__)
# each domain error's HTTP status (a subclass answers as its nearest listed ancestor)
STATUS: dict[type[DomainError], int] = {
    Unauthorized: 401, Forbidden: 403, NotFound: 404, Conflict: 409, PayloadTooLarge: 413,
    Unprocessable: 422, TooManyRequests: 429, Unavailable: 503, DomainError: 400}
# the handled kinds, for `app.exception_handler`; psycopg's own come from the asyncio writer
HANDLED = (DomainError, RequestValidationError, IntegrityError, psycopg.IntegrityError,
           OperationalError, psycopg.OperationalError, HTTPException)


def validation_detail(errors: Any) -> list[dict[str, Any]]:
    """FastAPI's shape (loc, msg, type) plus `field`, and nothing unserialisable."""
    detail = []
    for err in errors:
        loc = [str(part) for part in err.get("loc", ())]
        field = ".".join(loc[1:]) if loc and loc[0] in ("body", "query", "path") else ".".join(loc)
        msg = str(err.get("msg", ""))
        if err.get("type") == "json_invalid":  # loc holds a character position, not a field
            field, msg = "", f"malformed JSON body: {err.get('ctx', {}).get('error', msg)}"
        detail.append({"loc": loc, "field": field, "msg": msg, "type": str(err.get("type", ""))})
    return detail


def status_of(exc: DomainError) -> int:
    return next(STATUS[kind] for kind in type(exc).__mro__ if kind in STATUS)


def error_response(exc: Exception) -> tuple[int, Any, dict[str, str]] | None:
    """(status, detail, extra headers) for an exception the API answers; None otherwise."""
    if isinstance(exc, DomainError):  # busy or unavailable for a moment: say when to come back
        status = status_of(exc)
        if status in (429, 503):
            wait = math.ceil(getattr(exc, "retry_after_s", 1.0))
            return status, exc.detail, {"Retry-After": str(max(1, wait))}
        return status, exc.detail, {}
    if isinstance(exc, RequestValidationError):
        return 422, validation_detail(exc.errors()), {}
    if isinstance(exc, IntegrityError | psycopg.IntegrityError):
        log.info("integrity error: %s", exc)
        return 409, "conflicts with stored data (it changed concurrently or already exists)", {}
    if isinstance(exc, OperationalError | psycopg.OperationalError):
        log.warning("database error: %s", exc)
        return 503, "database unavailable, retry later", {"Retry-After": "1"}
    if isinstance(exc, HTTPException):
        return exc.status_code, exc.detail, dict(getattr(exc, "headers", None) or {})
    return None
