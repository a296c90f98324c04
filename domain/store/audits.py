"""What audits know of each device in a job (`audit_records`): its steps audited in full and
agreed (its probation), and the first step whose applied state holds a result of it that no
audit checked (where a job must rewind to when that device is found lying). Functions take a
session and flush; the caller owns the transaction (the step's commit, a rewind)."""

from __future__ import annotations

from collections.abc import Collection

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from domain.store.models import AuditRecord


def verified_steps(session: Session, job_id: str) -> dict[str, int]:
    """device id -> its steps of this job whose every result was audited and agreed."""
    rows = session.execute(select(AuditRecord.device_id, AuditRecord.verified_steps)
                           .where(AuditRecord.job_id == job_id))
    return {device: int(steps) for device, steps in rows}


def first_unaudited(session: Session, job_id: str, device_id: str) -> int | None:
    """The first step whose applied state holds an unaudited result of the device; None if
    every result of it that the job's state holds was audited."""
    row = session.get(AuditRecord, (job_id, device_id))
    return row.first_unaudited_step if row is not None else None


def record_step(session: Session, job_id: str, step: int, agreed: Collection[str],
                unaudited: Collection[str]) -> None:
    """Step `step` applied (called inside its commit, which holds the job's row): each device
    in `agreed` had every result audited and agreed (one more step of its probation served),
    each in `unaudited` had a result applied that no audit checked."""
    wanted = set(agreed) | set(unaudited)
    if not wanted:
        return
    rows = {r.device_id: r for r in session.scalars(
        select(AuditRecord).where(AuditRecord.job_id == job_id,
                                  AuditRecord.device_id.in_(sorted(wanted))))}
    for device in sorted(wanted):
        row = rows.get(device)
        if row is None:
            row = AuditRecord(job_id=job_id, device_id=device, verified_steps=0,
                              first_unaudited_step=None)
            session.add(row)
        if device in agreed:
            row.verified_steps = (row.verified_steps or 0) + 1
        if device in unaudited and (row.first_unaudited_step is None
                                    or step < row.first_unaudited_step):
            row.first_unaudited_step = step
    session.flush()


def forget_unaudited(session: Session, job_id: str, from_step: int) -> None:
    """A rewind to `from_step` undid every result applied at or after it: unaudited results
    recorded there are no longer in the job's state."""
    session.execute(update(AuditRecord)
                    .where(AuditRecord.job_id == job_id,
                           AuditRecord.first_unaudited_step >= from_step)
                    .values(first_unaudited_step=None))
