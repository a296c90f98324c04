"""Recorded state changes (Kubernetes-style events) about devices and jobs."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from domain.store.models import Event


def record(session: Session, reason: str, message: str, *, now: dt.datetime,
           device_id: str | None = None, job_id: str | None = None, kind: str = "Normal",
           data: dict[str, Any] | None = None) -> Event:
    event = Event(ts=now, reason=reason, message=message, device_id=device_id, job_id=job_id,
                  kind=kind, data=data or {})
    session.add(event)
    return event


def event_row(reason: str, message: str, *, now: dt.datetime, device_id: str | None = None,
              job_id: str | None = None, kind: str = "Normal") -> dict[str, Any]:
    """The same event as a plain row, for bulk inserts."""
    return {"ts": now, "reason": reason, "message": message, "device_id": device_id,
            "job_id": job_id, "kind": kind, "data": {}, "created": now, "updated": now}


def list_events(session: Session, *, device_id: str | None = None, job_id: str | None = None,
                limit: int = 100, offset: int = 0) -> Sequence[Event]:
    query = select(Event).order_by(Event.id)
    if device_id is not None:
        query = query.where(Event.device_id == device_id)
    if job_id is not None:
        query = query.where(Event.job_id == job_id)
    return session.scalars(query.limit(limit + 1).offset(offset)).all()
