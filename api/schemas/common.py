"""Shared schema pieces: the forbid-extras request base, list pages, labels, events."""

from __future__ import annotations

import datetime as dt
import re
from typing import Annotated, Any, Generic, TypeVar
from urllib.parse import parse_qsl

from fastapi import Query
from fastapi.exceptions import RequestValidationError
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

# \Z, not $: $ also matches before a final newline
_LABEL_KEY = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9_./-]{0,61}[A-Za-z0-9])?\Z")
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9_./-]{0,63}\Z")


# every list's paging, once: an offset past any table is a clear 422, not Postgres' bigint
# overflow (a 500)
MAX_OFFSET = 2**31 - 1
Limit = Query(100, ge=1, le=1000, description="how many items at most")
Offset = Query(0, ge=0, le=MAX_OFFSET, description="where the page starts (next_offset)")


class RequestModel(BaseModel):
    """Every request body: unknown fields are an error, never silently ignored."""

    model_config = ConfigDict(extra="forbid")


class ReadModel(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class Page(BaseModel, Generic[T]):
    """A page of a list: `next_offset` is where the next page starts, null on the last one."""

    items: list[T]
    next_offset: int | None = None


def check_labels(labels: dict[str, str]) -> dict[str, str]:
    if len(labels) > 64:
        raise ValueError("at most 64 labels")
    for key, value in labels.items():
        if not _LABEL_KEY.match(key):
            raise ValueError(f"label key {key!r}: 1-63 of A-Z a-z 0-9 _ . / -, alphanumeric ends")
        if not _LABEL_VALUE.match(value):
            raise ValueError(f"label {key}={value!r}: value is 0-63 of A-Z a-z 0-9 _ . / -")
    return labels


Labels = Annotated[dict[str, str], AfterValidator(check_labels)]


class EventRead(ReadModel):
    id: int
    ts: dt.datetime
    kind: str
    reason: str
    message: str
    job_id: str | None = None
    device_id: str | None = None
    data: dict[str, Any] = {}


def page_of(items: list[Any], limit: int, offset: int) -> dict[str, Any]:
    """Build a page from `limit + 1` fetched rows (the extra row says there is a next page)."""
    more = len(items) > limit
    return {"items": items[:limit], "next_offset": offset + limit if more else None}


def parse_query(model: type[M], query_string: str) -> M:
    """Validate a query string's parameters (the last of a repeated one wins, as in FastAPI);
    errors look like FastAPI's own (loc "query")."""
    try:
        return model.model_validate(dict(parse_qsl(query_string)))
    except ValidationError as exc:
        errors = [{**err, "loc": ("query", *err["loc"])} for err in exc.errors(include_url=False)]
        raise RequestValidationError(errors) from None


def parse_body(model: type[M], raw: bytes) -> M:
    """Validate a JSON body straight from bytes; errors look like FastAPI's own (loc "body")."""
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        errors = [{**err, "loc": ("body", *err["loc"])} for err in exc.errors(include_url=False)]
        raise RequestValidationError(errors) from None


class ErrorOut(BaseModel):
    """Every error answer: `detail` says what is wrong (a 422 lists each field's problem)."""

    detail: str | list[dict[str, Any]] = Field(
        description="what is wrong: a sentence, or for a 422 one entry per field "
                    "(loc, field, msg, type)")


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI `responses` for these error statuses, each with the error schema."""
    return {code: {"model": ErrorOut, "description": ERROR_MEANINGS[code]} for code in codes}


ERROR_MEANINGS = {
    401: "no token, or an unknown, revoked or expired one",
    403: "a token of the wrong kind, or another device's",
    404: "not found (another user's job answers the same)",
    409: "conflicts with the current state (a finished job, a step no longer current)",
    413: "the body is larger than the limit",
    422: "the request is malformed: the detail names each field and its problem",
    429: "too many requests from this device for now: see Retry-After",
    503: "a part the request needs is down for a moment: see Retry-After",
}
