"""Jobs: submission (after complete validation), reads with their devices, cancel, curves."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import bindparam, select, update
from sqlalchemy.orm import Session

from domain.errors import Conflict, Invalid, NotFound
from domain.store import datasets, events, owners
from domain.store.energy import step_energy
from domain.store.models import Checkpoint, Job, ShardAssignment, StepMetric
from domain.store.states import Event as StateEvent
from domain.store.states import transition
from domain.store.tokens import Principal
from engine.data import DatasetError, dataset_info
from engine.plan import ModelPlan, model_plan
from engine.sampler import total_steps
from engine.slices import SliceError
from engine.spec import TrainSpec
from wire.states import JOB_STATES, JobState


def dataset_facts(name: str, data_dir: Path) -> Any:
    try:
        return dataset_info(name, data_dir)
    except DatasetError as exc:
        raise Invalid("dataset", str(exc)) from exc


def check_spec(spec: dict[str, Any], data_dir: Path, session: Session,
               principal: Principal) -> ModelPlan:
    """The cross-checks that need the dataset (one `principal` may use: 404 for another
    user's, as for none; shards fit, at least one step per epoch, the model builds on its
    samples and is not too large), and the job's plan."""
    datasets.require_usable(session, spec["dataset"], principal)
    info = dataset_facts(spec["dataset"], data_dir)
    if spec["shards"] > info.n_train:
        raise Invalid("shards", f"shards ({spec['shards']}) must be <= the {info.n_train} "
                      f"training samples of dataset {spec['dataset']!r}")
    try:
        total_steps(info.n_train, spec["shards"], spec["global_batch_size"], spec["epochs"])
    except ValueError as exc:
        raise Invalid("global_batch_size", str(exc)) from exc
    # counted without allocating the model (a spec with 10^9 classes must not cost 60 GB)
    try:
        train = TrainSpec.from_job_spec(spec, n_train=info.n_train)
        return model_plan(train, info.input_shape, info.num_classes)
    except SliceError as exc:
        raise Invalid("slices", str(exc)) from exc
    except ValueError as exc:  # ModelTooLarge, SpecError and LayerError are ValueErrors
        raise Invalid("model", str(exc)) from exc


def plan_summary(spec: dict[str, Any], plan: ModelPlan) -> dict[str, Any]:
    """The plan as a job keeps and shows it, counting the devices the job asks for at most."""
    devices = min(spec["placement"]["max_devices"], spec["shards"])
    return plan.as_dict(devices, spec["shards"])


def submit_job(session: Session, spec: dict[str, Any], *, plan: dict[str, Any],
               principal: Principal, now: dt.datetime) -> Job:
    total_steps = plan["total_steps"]
    job = Job(name=spec["name"], spec=spec, state=JobState.PENDING.value, priority=spec["priority"], step=0,
              total_steps=total_steps, metrics={}, owner_token_id=principal.token_id,
              owner=principal.user, plan={k: v for k, v in plan.items() if k != "layers"})
    session.add(job)
    session.flush()
    events.record(session, "Submitted", f"{total_steps} steps on {spec['dataset']!r}",
                  now=now, job_id=job.id)
    return job


def get_job(session: Session, job_id: str, principal: Principal | None = None) -> Job:
    """The job, for a principal allowed to see it: an admin sees every job, a user only their
    own (another user's job is answered as not found: its existence is not theirs to know;
    domain.store.owners, the one rule of every user-created resource)."""
    if principal is None:
        job = session.get(Job, job_id)
        if job is None:
            raise NotFound(f"job {job_id} not found")
        return job
    return owners.find(session, Job, job_id, principal, f"job {job_id}")


def may_see(job: Job, principal: Principal) -> bool:
    return owners.may_see(job, principal)


@dataclass
class Holdings:
    """Who holds a job's shards: every device (primary or backup) and each one's primary shards."""

    devices: list[str] = field(default_factory=list)
    shards: dict[str, list[int]] = field(default_factory=dict)


def holdings_of(session: Session, job_ids: list[str]) -> dict[str, Holdings]:
    """job id -> its holdings, for a whole page in one query."""
    held = {job_id: Holdings() for job_id in job_ids}
    if not job_ids:
        return held
    rows = session.execute(
        select(ShardAssignment.job_id, ShardAssignment.device_id, ShardAssignment.shard,
               ShardAssignment.role)
        .where(ShardAssignment.job_id.in_(job_ids))
        .order_by(ShardAssignment.job_id, ShardAssignment.device_id, ShardAssignment.shard)
    )
    for job_id, device_id, shard, role in rows:
        h = held[job_id]
        if not h.devices or h.devices[-1] != device_id:  # rows come ordered by device
            h.devices.append(device_id)
        if role == "primary":
            h.shards.setdefault(device_id, []).append(shard)
    return held


@dataclass(frozen=True)
class JobAssignments:
    """What a job's shard assignments say at a step boundary, from one query: the step's
    commit reads them on the step's critical path (the phones wait for it)."""

    primaries: dict[int, str]  # shard -> its primary device
    devices: list[str]  # every device holding a shard of the job, primary or backup
    backups: int  # backup assignments (stragglers' shards computed twice)
    audits: int = 0  # audited nodes' rows (scheduler.audits: roles audit and decide)


def job_assignments(session: Session, job_id: str) -> JobAssignments:
    rows = session.execute(
        select(ShardAssignment.shard, ShardAssignment.device_id, ShardAssignment.role)
        .where(ShardAssignment.job_id == job_id)
    ).all()
    return JobAssignments({int(shard): device for shard, device, role in rows if role == "primary"},
                          sorted({device for _, device, _ in rows}),
                          sum(role == "backup" for _, _, role in rows),
                          sum(role in ("audit", "decide") for _, _, role in rows))


def parse_job_states(state: str | None) -> list[str]:
    states = [s.strip() for s in (state or "").split(",") if s.strip()]
    for value in states:
        if value not in JOB_STATES:
            raise Invalid("state", f"unknown job state {value!r}; one of {', '.join(JOB_STATES)}",
                          where="query")
    return states


def list_jobs(session: Session, *, principal: Principal, states: list[str], limit: int,
              offset: int) -> Sequence[Job]:
    """Newest first: every job for an admin, a user's own for a user."""
    query = select(Job).where(owners.visible(Job, principal)).order_by(Job.created.desc(),
                                                                        Job.id)
    if states:
        query = query.where(Job.state.in_(states))
    return session.scalars(query.limit(limit + 1).offset(offset)).all()


def cancel_job(session: Session, job_id: str, now: dt.datetime, principal: Principal) -> Job:
    """Pending/Running -> Cancelled with a guarded UPDATE; 403 for another user's job, 409 once
    the job has finished."""
    job = get_job(session, job_id, principal)
    by = principal.name or principal.kind
    cancelled = transition(session, job_id, JobState.CANCELLED,
                           StateEvent(JobState.CANCELLED.value, f"cancelled by {by}"), now=now,
                           reason=f"cancelled by {by}", finished_at=now)
    if not cancelled:
        session.refresh(job)
        raise Conflict(f"job {job_id} already finished ({job.state}); nothing to cancel")
    session.flush()
    session.refresh(job)
    return job


def fail_diverged(session: Session, job_id: str, step: int, reason: str,
                  now: dt.datetime) -> bool:
    """Running at `step` -> Failed, the training having diverged there (a shard's loss or
    gradient is not finite: every device computes the same bits, so recomputing elsewhere would
    not help, and the step cannot be applied). False when the job was elsewhere already."""
    return transition(session, job_id, JobState.FAILED,
                      StateEvent("Diverged", reason, "Warning"), now=now,
                      expect={"step": step, "state": JobState.RUNNING.value}, reason=reason,
                      finished_at=now)


STEP_METRIC_FIELDS = tuple(column.key for column in StepMetric.__table__.columns)


def step_metrics(session: Session, job_id: str, principal: Principal, *, since_step: int,
                 limit: int, now: dt.datetime, telemetry_kept_s: float) -> list[dict[str, Any]]:
    """The per-step curve from `since_step`, `limit` + 1 rows (the last says there are more).

    A step's energy is not known at its commit (the phones' samples of it arrive with their
    next heartbeats): it is their power integrated over the step's time (domain.store.energy),
    worked out here from the first step not kept yet, and kept in the row once final, so a
    curve read again (the job page, every few seconds) and one read after the samples are
    pruned (`telemetry_kept_s`) cost and say the same. The caller commits what is kept."""
    job = get_job(session, job_id, principal)
    rows = session.scalars(
        select(StepMetric).where(StepMetric.job_id == job_id, StepMetric.step >= since_step)
        .order_by(StepMetric.step).limit(limit + 1)).all()
    curve = [{key: getattr(row, key) for key in STEP_METRIC_FIELDS} for row in rows]
    first = next((i for i, point in enumerate(curve) if point["energy_j"] is None), None)
    if first is None:
        return curve
    begin = curve[first - 1]["ts"] if first else session.scalar(select(StepMetric.ts).where(
        StepMetric.job_id == job_id, StepMetric.step == curve[0]["step"] - 1))
    todo = curve[first:]
    energies = step_energy(session, job, begin, [point["ts"] for point in todo], now,
                           known_since=now - dt.timedelta(seconds=telemetry_kept_s))
    keep = []
    for point, energy in zip(todo, energies):
        if point["energy_j"] is None:
            point["energy_j"] = energy.joules
            if energy.final and energy.joules is not None:
                keep.append({"j": job_id, "s": point["step"], "e": energy.joules})
    if keep:
        session.execute(update(StepMetric.__table__)
                        .where(StepMetric.__table__.c.job_id == bindparam("j"),
                               StepMetric.__table__.c.step == bindparam("s"),
                               StepMetric.__table__.c.energy_j.is_(None))
                        .values(energy_j=bindparam("e")), keep)
    return curve


def latest_checkpoint(session: Session, job_id: str, principal: Principal,
                      data_dir: Path) -> tuple[Checkpoint, Path]:
    get_job(session, job_id, principal)
    row = session.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id)
                          .order_by(Checkpoint.step.desc(), Checkpoint.id.desc())).first()
    if row is None:
        raise NotFound(f"job {job_id} has no checkpoint yet")
    path = Path(row.path)
    path = path if path.is_absolute() else data_dir / path
    if not path.is_file():
        raise NotFound(f"checkpoint of step {row.step} is recorded but its file is missing")
    return row, path
