"""Tenancy, written once for every resource a person creates (jobs, datasets, and anything
later): who owns it, who may see it, who may change it.

- A resource records its owner when it is created: `owner_of(principal)`, the user's token id
  (names are free text: two tokens named alike must not share anything), or None for an
  admin's.
- An admin sees and changes everything. A user sees their own, and what an admin made
  public (`public`, for the kinds that can be shared); a user changes only their own.
- Anything else is answered as not found (404), never as forbidden: that another user's
  resource exists is not the asker's to know. `find` does that for a row by its key and
  `visible` for a query, so a new kind of resource gets the rule by using them, not by
  writing it again.

A model takes part by having an `owner` column (String, nullable, indexed) and, when it can
be shared, a `public` column (Boolean).
"""

from __future__ import annotations

from typing import Any, TypeVar

from sqlalchemy import ColumnElement, false, or_, true
from sqlalchemy.orm import Session

from domain.errors import Forbidden, NotFound
from domain.store.tokens import Principal

T = TypeVar("T")


def owner_of(principal: Principal) -> str | None:
    """What a resource created by `principal` records as its owner."""
    return principal.user


def may_see(row: Any, principal: Principal) -> bool:
    if principal.is_admin:
        return True
    if bool(getattr(row, "public", False)):
        return True
    return row.owner is not None and row.owner == principal.user


def may_change(row: Any, principal: Principal) -> bool:
    return principal.is_admin or (row.owner is not None and row.owner == principal.user)


def visible(model: Any, principal: Principal) -> ColumnElement[bool]:
    """The WHERE clause of what `principal` may see of `model`'s rows."""
    if principal.is_admin:
        return true()
    mine = model.owner == principal.user if principal.user is not None else false()
    shared = getattr(model, "public", None)
    return or_(mine, shared.is_(True)) if shared is not None else mine


def find(session: Session, model: type[T], key: Any, principal: Principal, what: str) -> T:
    """The row of `model` with primary key `key`, when `principal` may see it; 404 (naming
    `what`) for a missing row and for one that is not theirs alike."""
    row = session.get(model, key)
    if row is None or not may_see(row, principal):
        raise NotFound(f"{what} not found")
    return row


def find_to_change(session: Session, model: type[T], key: Any, principal: Principal,
                   what: str) -> T:
    """`find`, for a change (delete, edit): 404 for what they may not see, 403 for what they
    may see but not change (another user's public resource)."""
    row = find(session, model, key, principal, what)
    if not may_change(row, principal):
        raise Forbidden(f"{what} is not yours: only its owner or an admin may change it")
    return row
