"""What the store keeps: the newest K events and step metrics per job, device events for a
while. Run by reconcile at most every 10 minutes (scheduler/tasks/reconcile.py: prune_history)."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.orm import InstrumentedAttribute, Session

from domain.store.models import Event, StepMetric


@dataclass(frozen=True)
class Pruned:
    events: int = 0
    step_metrics: int = 0


def prune_job_history(session: Session, *, events_kept: int, step_metrics_kept: int,
                      device_events_before: dt.datetime) -> Pruned:
    """Delete all but the newest `events_kept` events and `step_metrics_kept` step metrics of
    each job (a count per job over the job_id index finds the jobs over the bound; only theirs
    are deleted), and device events (those of no job) older than `device_events_before`."""
    events = _keep_newest(session, Event.job_id, Event.id, events_kept)
    events += int(session.execute(delete(Event).where(
        Event.job_id.is_(None), Event.ts < device_events_before)).rowcount or 0)  # type: ignore[attr-defined]
    metrics = _keep_newest(session, StepMetric.job_id, StepMetric.step, step_metrics_kept)
    return Pruned(events, metrics)


def _keep_newest(session: Session, job_col: InstrumentedAttribute[Any],
                 order_col: InstrumentedAttribute[Any], kept: int) -> int:
    """Keep the `kept` rows with the highest `order_col` of each `job_col`."""
    over = session.scalars(select(job_col).where(job_col.is_not(None)).group_by(job_col)
                           .having(func.count() > kept)).all()
    removed = 0
    for job_id in over:
        cutoff = session.scalar(select(order_col).where(job_col == job_id)
                                .order_by(order_col.desc()).offset(kept - 1).limit(1))
        if cutoff is not None:
            result = session.execute(delete(job_col.class_).where(job_col == job_id,
                                                                  order_col < cutoff))
            removed += int(result.rowcount or 0)  # type: ignore[attr-defined]
    return removed
