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

from domain.errors import ApiError

log = logging.getLogger(__name__)
# the handled kinds, for `app.exception_handler`; psycopg's own come from the asyncio writer
HANDLED = (ApiError, RequestValidationError, IntegrityError, psycopg.IntegrityError,
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


def error_response(exc: Exception) -> tuple[int, Any, dict[str, str]] | None:
    """(status, detail, extra headers) for an exception the API answers; None otherwise."""
    if isinstance(exc, ApiError):  # busy or unavailable for a moment: say when to come back
        if exc.status_code in (429, 503):
            wait = math.ceil(getattr(exc, "retry_after_s", 1.0))
            return exc.status_code, exc.detail, {"Retry-After": str(max(1, wait))}
        return exc.status_code, exc.detail, {}
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
