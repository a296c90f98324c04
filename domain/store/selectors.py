"""Label selectors as Kubernetes writes them: `rack=a`, `rack==a`, `rack!=a`, `rack in (a,b)`,
`rack notin (a,b)`, `rack` (has the label), `!rack` (has not); terms joined by commas, all must
hold. `!=` and `notin` match objects without the label, as in Kubernetes."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from sqlalchemy import ColumnElement, or_

from domain.errors import Invalid

KEY = r"[A-Za-z0-9]([A-Za-z0-9._/-]*[A-Za-z0-9])?"
VALUE = r"[A-Za-z0-9._/-]*"  # as a label value may be (api.schemas.common)
_COMMA = re.compile(r",(?![^(]*\))")  # a comma outside parentheses ends a term
_SET = re.compile(rf"^({KEY})\s+(in|notin)\s+\(([^)]*)\)$")
_EQ = re.compile(rf"^({KEY})\s*(==|!=|=)\s*({VALUE})$")
_EXISTS = re.compile(rf"^(!?)\s*({KEY})$")


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # in | notin | exists | !exists ("=" is "in" one value, "!=" "notin" one value)
    values: tuple[str, ...] = ()


def parse_selector(text: str | None) -> list[Requirement]:
    """The requirements of a selector; a 422 naming the term that is not one."""
    if not text or not text.strip():
        return []
    terms = [term.strip() for term in _COMMA.split(text)]
    if not all(terms):
        raise Invalid("selector", f"selector {text!r} has an empty term", where="query")
    return [_requirement(term) for term in terms]


def _requirement(term: str) -> Requirement:
    if m := _SET.match(term):
        values = tuple(v.strip() for v in m.group(4).split(","))
        if not m.group(4).strip() or not all(re.fullmatch(VALUE, v) for v in values):
            raise Invalid("selector", f"bad value in {term!r}", where="query")
        return Requirement(m.group(1), m.group(3), values)
    if m := _EQ.match(term):
        return Requirement(m.group(1), "notin" if m.group(3) == "!=" else "in", (m.group(4),))
    if m := _EXISTS.match(term):
        return Requirement(m.group(2), "!exists" if m.group(1) else "exists")
    raise Invalid("selector", f"selector term {term!r} is none of key=value, key!=value, "
                  "key in (a,b), key notin (a,b), key, !key", where="query")


def matches(reqs: list[Requirement], labels: dict[str, str]) -> bool:
    """Whether labels satisfy every requirement (the SQL below says the same)."""
    for r in reqs:
        value = labels.get(r.key)
        ok = {"in": value in r.values, "notin": value not in r.values,
              "exists": value is not None, "!exists": value is None}[r.op]
        if not ok:
            return False
    return True


def sql_conditions(reqs: list[Requirement], labels: Any) -> list[ColumnElement[bool]]:
    """WHERE conditions on a JSON labels column, one per requirement (SQLite and Postgres)."""
    out: list[ColumnElement[bool]] = []
    for r in reqs:
        value = labels[r.key].as_string()
        if r.op == "in":
            out.append(value.in_(r.values))
        elif r.op == "notin":
            out.append(or_(value.is_(None), value.not_in(r.values)))
        elif r.op == "exists":
            out.append(value.is_not(None))
        else:
            out.append(value.is_(None))
    return out
