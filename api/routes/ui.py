"""`/ui`: the fleet and its jobs as pages that refresh themselves, for a browser (what a user of
the embedded mode sees instead of Grafana). Not API operations (left out of the OpenAPI
document). A browser cannot send a bearer header on navigation, so the login form takes a
user or admin token once and keeps it in an HttpOnly, SameSite=Strict cookie scoped to /ui;
every page checks it as the API checks a bearer token, and a user sees only their own jobs.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from sqlalchemy import Integer, cast, extract, func, select
from sqlalchemy.orm import Session

from api.auth import Authenticator
from api.deps import SessionDep
from api.schemas.common import EventRead
from api.schemas.devices import DeviceRead
from api.schemas.jobs import JobRead, StepMetricRead
from domain.errors import DomainError
from domain.store import devices, events, jobs
from domain.store.models import Event, StepMetric, TelemetrySample
from domain.store.tokens import Principal
from pictures import fleet, report
from pictures.history import Buckets, DeviceHistory, device_rates, telemetry_history
from wire.states import FINISHED_STATES

router = APIRouter(prefix="/ui", include_in_schema=False)
COOKIE = "phalanx_ui_token"
COOKIE_MAX_AGE_S = 12 * 3600
REFRESH_S = 5
SHOWN = 500  # devices and jobs per page
CURVE_POINTS = 2000  # a job page's curves: every k-th step past this many
HOUR = Buckets(count=60, width_s=60.0)  # the fleet's sparklines: the last hour, 60 points
_HOUR = dt.timedelta(seconds=HOUR.count * HOUR.width_s)
SPARK_DEVICES = 50  # phones drawn with their last hour (the first in the page's order)
RATE_ROWS = 20_000  # the rates' reads at most: (job, bucket) sums, placement events
PLACEMENT_REASONS = ("Scheduled", "ShardsMoved")  # the events that carry `counts`


def _person(auth: Authenticator, token: str | None) -> Principal | None:
    """The user or admin a token is (as a bearer token would be checked), else None."""
    if not token:
        return None
    try:
        token_hash, principal = auth.cached(token)
        principal = principal or auth.lookup(token_hash)
    except DomainError:
        return None
    return principal if principal.kind in ("admin", "user") else None


def _principal(request: Request) -> Principal | None:
    return _person(request.app.state.authenticator, request.cookies.get(COOKIE))


def _dump(model, rows) -> list[dict]:
    return [model.model_validate(r).model_dump(mode="json") for r in rows]


@router.get("", response_class=HTMLResponse)
def fleet_page(request: Request, session: SessionDep, sort: str | None = None) -> Response:
    principal = _principal(request)
    if principal is None:
        return HTMLResponse(fleet.login())
    device_rows = devices.list_devices(session, states=[], selector=[], limit=SHOWN, offset=0)
    job_rows = list(jobs.list_jobs(session, principal=principal, states=[], limit=SHOWN,
                                   offset=0))
    held = jobs.holdings_of(session, [j.id for j in job_rows])
    job_dicts = [JobRead.model_validate(j).model_copy(update={
        "devices": held[j.id].devices, "shards": held[j.id].shards}).model_dump(mode="json")
        for j in job_rows]
    device_dicts = _dump(DeviceRead, device_rows)
    now = request.app.state.clock()
    rates = _rates(session, now)
    ordered = fleet.sort_devices(device_dicts, sort, fleet.shards_held(job_dicts),
                                 {d: DeviceHistory(rate=r) for d, r in rates.items()})
    drawn = [str(d["id"]) for d in ordered[:SPARK_DEVICES]]
    history = _telemetry(session, drawn, now)
    for device in drawn:
        history.setdefault(device, DeviceHistory()).rate = rates.get(device, [])
    return HTMLResponse(fleet.fleet(device_dicts, job_dicts, REFRESH_S, sort=sort,
                                    history=history, span_s=_HOUR.total_seconds()))


def _bucket(session: Session, ts: Any, now: dt.datetime) -> Any:
    """The HOUR's bucket of a timestamp column, in SQL (0 = the oldest). Postgres casts 2.7 to
    3, SQLite truncates it and may lack floor(); its epoch to the microsecond (julianday, not
    strftime's whole seconds), so both put a sample in the same bucket."""
    start = now.timestamp() - HOUR.count * HOUR.width_s
    if session.get_bind().dialect.name == "postgresql":
        return func.floor((extract("epoch", ts) - start) / HOUR.width_s)
    return cast(((func.julianday(ts) - 2440587.5) * 86400.0 - start) / HOUR.width_s, Integer)


def _telemetry(session: Session, device_ids: list[str], now: dt.datetime
               ) -> dict[str, DeviceHistory]:
    """Battery and temperature of `device_ids` over the last hour, averaged per bucket in SQL
    (at most HOUR.count rows a phone, read through the (device_id, ts) index)."""
    if not device_ids:
        return {}
    t = TelemetrySample
    bucket = _bucket(session, t.ts, now).label("bucket")
    rows = session.execute(
        select(t.device_id, bucket, func.avg(t.battery_pct), func.avg(t.battery_temp_c),
               func.avg(t.cpu_temp_c))
        .where(t.device_id.in_(device_ids), t.ts > now - _HOUR, t.ts <= now)
        .group_by(t.device_id, bucket)).all()
    return telemetry_history(rows, HOUR)


def _rates(session: Session, now: dt.datetime) -> dict[str, list[tuple[float, float]]]:
    """Samples a second per phone over the last hour: the samples the jobs' steps trained per
    bucket (SQL sums, at most HOUR.count rows a job), shared out by the shards each phone held
    (the jobs' placement events)."""
    m = StepMetric
    bucket = _bucket(session, m.ts, now).label("bucket")
    samples = session.execute(
        select(m.job_id, bucket, func.sum(m.samples), func.min(m.step), func.max(m.step))
        .where(m.ts > now - _HOUR, m.ts <= now).group_by(m.job_id, bucket)
        .limit(RATE_ROWS)).all()
    job_ids = sorted({row[0] for row in samples})
    placements: dict[str, list[dict[str, Any]]] = {}
    for job_id, data in session.execute(
            select(Event.job_id, Event.data).where(Event.job_id.in_(job_ids),
                                                   Event.reason.in_(PLACEMENT_REASONS))
            .order_by(Event.id).limit(RATE_ROWS)).all() if job_ids else []:
        placements.setdefault(job_id, []).append({"data": data})
    return device_rates(samples, placements, HOUR)


@router.get("/jobs/{job_id}", response_class=HTMLResponse)
def job_page(job_id: str, request: Request, session: SessionDep) -> Response:
    principal = _principal(request)
    if principal is None:
        return RedirectResponse("/ui", status_code=303)
    job = jobs.get_job(session, job_id, principal)  # another user's job: 404
    held = jobs.holdings_of(session, [job_id])[job_id]
    job_dict = JobRead.model_validate(job).model_copy(update={
        "devices": held.devices, "shards": held.shards}).model_dump(mode="json")
    rows = jobs.step_metrics(session, job_id, principal, since_step=0, limit=100_000,
                             now=request.app.state.clock(),
                             telemetry_kept_s=request.app.state.settings.telemetry_retention_s)
    session.commit()  # the steps' energies it found final are kept
    curve = _dump(StepMetricRead, _thinned(rows))
    job_events = _dump(EventRead, events.list_events(session, job_id=job_id, limit=5_000,
                                                      offset=0))
    seen = set(held.devices) | {e["device_id"] for e in job_events if e.get("device_id")}
    for e in job_events:
        seen |= set((e.get("data") or {}).get("counts") or {})
    names = devices.names_of(session, seen)
    live = None if job.state in FINISHED_STATES else REFRESH_S
    return HTMLResponse(report.render(job_dict, curve, job_events, names, live))


def _thinned(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every k-th step past CURVE_POINTS (a page that reloads every 5 s stays light), the last,
    and every step with a validation point (a few: every `eval_every` steps). A kept step's
    energy is that of the steps since the last kept one, so the cumulative energy holds."""
    every, kept, skipped = max(1, len(rows) // CURVE_POINTS), [], 0.0
    for i, row in enumerate(rows):
        if not (i % every == 0 or i == len(rows) - 1 or row.get("val_loss") is not None
                or row.get("val_accuracy") is not None):
            skipped += row.get("energy_j") or 0.0
            continue
        if skipped and row.get("energy_j") is not None:
            row = {**row, "energy_j": row["energy_j"] + skipped}
            skipped = 0.0
        kept.append(row)
    return kept


@router.post("/login")
def log_in(request: Request, token: str = Form("")) -> Response:
    if _person(request.app.state.authenticator, token.strip()) is None:
        return HTMLResponse(fleet.login("That is not a valid user or admin token."),
                            status_code=401)
    answer = RedirectResponse("/ui", status_code=303)
    # Secure whenever the browser talks https, to us or to the TLS proxy in front of us
    https = request.url.scheme == "https" or \
        request.headers.get("x-forwarded-proto", "").split(",")[0].strip() == "https"
    answer.set_cookie(COOKIE, token.strip(), max_age=COOKIE_MAX_AGE_S, path="/ui", httponly=True,
                      samesite="strict", secure=https)
    return answer


@router.get("/logout")
async def log_out() -> Response:
    answer = RedirectResponse("/ui", status_code=303)
    answer.delete_cookie(COOKIE, path="/ui")
    return answer
