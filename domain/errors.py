"""Domain errors raised by the store and the rules. They say what went wrong, never how a
transport answers it: `api.error_responses` maps each kind to its HTTP status (one table)."""

from __future__ import annotations

from typing import Any


class DomainError(Exception):
    """A request the domain refuses; `detail` says why, for the caller."""

    def __init__(self, detail: Any) -> None:
        super().__init__(detail)
        self.detail = detail


class Unauthorized(DomainError):
    """No valid credentials."""


class Forbidden(DomainError):
    """Valid credentials that may not do this."""


class NotFound(DomainError):
    """Not there, or not the caller's to see."""


class Conflict(DomainError):
    """Not now: the stored state says otherwise (finished, taken, changed meanwhile)."""


class PayloadTooLarge(DomainError):
    """More bytes than a bound allows."""


class Unprocessable(DomainError):
    """Understood, but it does not fit (a results message for another model, a bad slice)."""


class Invalid(Unprocessable):
    """A request that parsed but makes no sense; `field` is the dotted path it is about."""

    def __init__(self, field: str, msg: str, where: str = "body") -> None:
        loc = [where, *field.split(".")] if field else [where]
        super().__init__([{"loc": loc, "field": field, "msg": msg, "type": "value_error"}])


class TooManyRequests(DomainError):
    """Over a rate or a bound for now: `retry_after_s` says when to come back."""

    def __init__(self, detail: Any, retry_after_s: float = 1.0) -> None:
        super().__init__(detail)
        self.retry_after_s = retry_after_s


class Unavailable(DomainError):
    """A part it needs is down or being restored: retry shortly."""
