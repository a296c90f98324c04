"""`/ui`: the fleet and its jobs as pages that refresh themselves, for a browser (what a user of
the embedded mode sees instead of Grafana). Not API operations (left out of the OpenAPI
document). A browser cannot send a bearer header on navigation, so the login form takes a
user or admin token once and keeps it in an HttpOnly, SameSite=Strict cookie scoped to /ui;
every page checks it as the API checks a bearer token, and a user sees only their own jobs.
"""

from __future__ import annotations

from fastapi import APIRouter, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from api.auth import Authenticator
from api.deps import SessionDep
from api.schemas.common import EventRead
from api.schemas.devices import DeviceRead
from api.schemas.jobs import JobRead, StepMetricRead
from domain.errors import DomainError
from domain.store import devices, events, jobs
from domain.store.tokens import Principal
from pictures import fleet, report
from wire.states import FINISHED_STATES

router = APIRouter(prefix="/ui", include_in_schema=False)
COOKIE = "phalanx_ui_token"
COOKIE_MAX_AGE_S = 12 * 3600
REFRESH_S = 5
SHOWN = 500  # devices and jobs per page
CURVE_POINTS = 2000  # a job page's curves: every k-th step past this many


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
def fleet_page(request: Request, session: SessionDep) -> Response:
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
    return HTMLResponse(fleet.fleet(_dump(DeviceRead, device_rows), job_dicts, REFRESH_S))


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
    every = max(1, len(rows) // CURVE_POINTS)  # a page that reloads every 5 s stays light
    curve = _dump(StepMetricRead, rows[::every] + ([rows[-1]] if len(rows) % every != 1
                                                   and every > 1 else []))
    job_events = _dump(EventRead, events.list_events(session, job_id=job_id, limit=5_000,
                                                      offset=0))
    seen = set(held.devices) | {e["device_id"] for e in job_events if e.get("device_id")}
    for e in job_events:
        seen |= set((e.get("data") or {}).get("counts") or {})
    names = devices.names_of(session, seen)
    live = None if job.state in FINISHED_STATES else REFRESH_S
    return HTMLResponse(report.render(job_dict, curve, job_events, names, live))


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
