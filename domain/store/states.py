"""The states a job and a device can be in, and the one way a job changes state.

Defined here once, read by the store, the schemas, the metrics and the scheduler. `str` enums,
so a state compares equal to its stored string. `transition` is a job's only way from one state
to another: a guarded UPDATE that wins only from a state allowed to reach the new one (and only
if the caller's other expectations, such as the step, still hold), with its event recorded in
the same transaction, as Prefect's orchestration rules guard a flow run's state. A write that
keeps the job's state (a step committed, its state renamed, a waiting job's reason) goes through
`update_job`, the same guard without the move: between them, every guarded write of a job's row
and the event it records.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Update, update
from sqlalchemy.orm import Session

from domain.store import events
from domain.store.models import Job
from wire.states import JobState

# from -> the states it may go to; a finished job never changes again
ALLOWED: Mapping[JobState, frozenset[JobState]] = {
    JobState.PENDING: frozenset({JobState.RUNNING, JobState.CANCELLED, JobState.FAILED}),
    JobState.RUNNING: frozenset({JobState.PENDING, JobState.SUCCEEDED, JobState.CANCELLED,
                                 JobState.FAILED}),
}


def sources(to: JobState) -> tuple[str, ...]:
    """The states a job may be in to move to `to`."""
    return tuple(s.value for s, targets in ALLOWED.items() if to in targets)


@dataclass(frozen=True)
class Event:
    """The event a transition records: reason, message, and optional kind and data."""

    reason: str
    message: str
    kind: str = "Normal"
    data: dict[str, Any] = field(default_factory=dict)


def transition(session: Session, job_id: str, to: JobState, event: Event, *,
               now: dt.datetime, expect: Mapping[str, Any] | None = None,
               **values: Any) -> bool:
    """Move the job to `to` from any state allowed to reach it, if every column in `expect`
    still has its value (a tuple: one of its values), setting `values` too; record `event`.
    False, and nothing recorded, when the job was not in such a state: another writer moved it
    first, or the move is not allowed."""
    stmt = _guarded(job_id, expect or {}).where(Job.state.in_(sources(to)))
    return _write(session, job_id, stmt, {"state": to.value, "updated": now, **values}, event,
                  now)


def update_job(session: Session, job_id: str, *, expect: Mapping[str, Any],
               event: Event | None = None, now: dt.datetime | None = None,
               **values: Any) -> bool:
    """Set `values` on the job if every column in `expect` still has its value (a tuple: one
    of its values), and record `event` (at `now`) when it did; True if it won. Not a way to
    change the job's state: that is `transition`'s alone."""
    if "state" in values:
        raise ValueError("a job's state changes only through transition()")
    if event is not None and now is None:
        raise ValueError("an event needs its time")
    return _write(session, job_id, _guarded(job_id, expect), values, event, now)


def _guarded(job_id: str, expect: Mapping[str, Any]) -> Update:
    """UPDATE jobs ... WHERE id = :id AND each expected column still has its value."""
    stmt = update(Job).where(Job.id == job_id)
    for column, value in expect.items():
        col = getattr(Job, column)
        stmt = stmt.where(col.in_(value) if isinstance(value, (tuple, list)) else col == value)
    return stmt


def _write(session: Session, job_id: str, stmt: Update, values: Mapping[str, Any],
           event: Event | None, now: dt.datetime | None) -> bool:
    result = session.execute(stmt.values(**values).execution_options(synchronize_session=False))
    if not result.rowcount:  # type: ignore[attr-defined]
        return False
    if event is not None and now is not None:
        events.record(session, event.reason, event.message, now=now, job_id=job_id,
                      kind=event.kind, data=event.data)
    return True
