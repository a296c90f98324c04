"""Domain errors raised by the store and routes; `api.main` maps each to its HTTP status."""

from __future__ import annotations

from typing import Any


class ApiError(Exception):
    status_code = 400

    def __init__(self, detail: Any) -> None:
        super().__init__(detail)
        self.detail = detail


class Unauthorized(ApiError):
    status_code = 401


class Forbidden(ApiError):
    status_code = 403


class NotFound(ApiError):
    status_code = 404


class Conflict(ApiError):
    status_code = 409


class PayloadTooLarge(ApiError):
    status_code = 413


class Invalid(ApiError):
    """A request that parsed but makes no sense; `field` is the dotted path it is about."""

    status_code = 422

    def __init__(self, field: str, msg: str, where: str = "body") -> None:
        loc = [where, *field.split(".")] if field else [where]
        super().__init__([{"loc": loc, "field": field, "msg": msg, "type": "value_error"}])


class TooManyRequests(ApiError):
    """Over a rate or a bound for now: `retry_after_s` says when to come back."""

    status_code = 429

    def __init__(self, detail: Any, retry_after_s: float = 1.0) -> None:
        super().__init__(detail)
        self.retry_after_s = retry_after_s


class Unavailable(ApiError):
    status_code = 503

