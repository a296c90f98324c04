"""Jobs: submit, list, get, cancel, events, the metrics curve, the latest checkpoint."""

from __future__ import annotations

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse, JSONResponse

from api.deps import ClockDep, SessionDep, SettingsDep, UserDep
from api.schemas.common import EventRead, Limit, Offset, Page, errors, page_of
from api.schemas.jobs import JobCreate, JobDryRun, JobRead, StepMetricRead
from domain.errors import Invalid
from domain.store import events, jobs

router = APIRouter(prefix="/v1/jobs", tags=["jobs"], responses=errors(401, 403, 422))


def _read(job, held: jobs.Holdings | None = None) -> JobRead:
    held = held or jobs.Holdings()
    return JobRead.model_validate(job).model_copy(update={"devices": held.devices,
                                                          "shards": held.shards})


@router.post("", status_code=201, response_model=JobRead,
             responses={200: {"model": JobDryRun, "description": "the plan of a dry run "
                                                                 "(nothing is created)"}})
def submit_job(body: JobCreate, request: Request, principal: UserDep, settings: SettingsDep,
               clock: ClockDep, session: SessionDep,
               dry_run: bool = Query(False, description="answer the job's plan and where it "
                                     "could run, and create nothing")):
    """Validate completely (the dataset and the model too), then queue as Pending; 422 when no
    phone of the fleet has the memory for the job's micro-batch."""
    spec = body.spec()
    with session.begin():  # the dataset must be one this token may use: 404 otherwise
        plan = jobs.plan_summary(spec, jobs.check_spec(spec, settings.data_dir, session,
                                                        principal))
        scheduler, memory = request.app.state.scheduler, plan["memory_per_device_bytes"]
        if dry_run:
            return JSONResponse(JobDryRun(
                name=spec["name"], spec=spec, total_steps=plan["total_steps"],
                owner=principal.user, plan=plan,
                placement=scheduler.eligibility(session, spec, memory)).model_dump(mode="json"))
        if (why := scheduler.refusal(session, spec, memory)) is not None:
            raise Invalid("model", why)
        job = jobs.submit_job(session, spec, plan=plan, now=clock(), principal=principal)
    request.app.state.scheduler.job_changed(job.id)
    return _read(job)


@router.get("", response_model=Page[JobRead])
def list_jobs(principal: UserDep, session: SessionDep, state: str | None = None,
              limit: int = Limit, offset: int = Offset):
    """Newest first: an admin sees every job, a user their own."""
    rows = list(jobs.list_jobs(session, principal=principal, states=jobs.parse_job_states(state),
                               limit=limit, offset=offset))
    held = jobs.holdings_of(session, [job.id for job in rows])
    return page_of([_read(job, held[job.id]) for job in rows], limit, offset)


@router.get("/{job_id}", response_model=JobRead)
def get_job(job_id: str, principal: UserDep, session: SessionDep):
    job = jobs.get_job(session, job_id, principal)
    return _read(job, jobs.holdings_of(session, [job_id])[job_id])


@router.post("/{job_id}/cancel", response_model=JobRead, responses=errors(409))
def cancel_job(job_id: str, request: Request, principal: UserDep, session: SessionDep,
           clock: ClockDep):
    """Pending or Running -> Cancelled; 409 when the job has already finished."""
    with session.begin():
        job = jobs.cancel_job(session, job_id, clock(), principal)
        held = jobs.holdings_of(session, [job_id])[job_id]
    request.app.state.scheduler.job_changed(job_id)
    return _read(job, held)


@router.get("/{job_id}/events", response_model=Page[EventRead])
def job_events(job_id: str, principal: UserDep, session: SessionDep, limit: int = Limit,
               offset: int = Offset):
    jobs.get_job(session, job_id, principal)
    rows = events.list_events(session, job_id=job_id, limit=limit, offset=offset)
    return page_of(list(rows), limit, offset)


@router.get("/{job_id}/metrics", response_model=Page[StepMetricRead])
def job_metrics(job_id: str, principal: UserDep, session: SessionDep, clock: ClockDep,
                settings: SettingsDep, since_step: int = Query(0, ge=0),
                limit: int = Query(10000, ge=1, le=100000)):
    """The per-step curve (loss, accuracy, lr, energy, ...), oldest step first."""
    with session.begin():  # the steps' energies it finds final are kept
        rows = jobs.step_metrics(session, job_id, principal, since_step=since_step, limit=limit,
                                 now=clock(), telemetry_kept_s=settings.telemetry_retention_s)
    more = len(rows) > limit
    return {"items": rows[:limit], "next_offset": rows[limit]["step"] if more else None}


@router.get("/{job_id}/checkpoint", response_class=FileResponse,
            responses={200: {"content": {"application/octet-stream": {}}}})
def get_checkpoint(job_id: str, principal: UserDep, session: SessionDep, settings: SettingsDep):
    """The latest checkpoint's weights as an .npz of named arrays."""
    row, path = jobs.latest_checkpoint(session, job_id, principal, settings.data_dir)
    return FileResponse(path, media_type="application/octet-stream",
                        filename=f"{job_id}-step{row.step}.npz",
                        headers={"X-Phalanx-Step": str(row.step), "X-Phalanx-Sha256": row.sha256})
