"""The step protocol (work, weights, shard data, gradient uploads): owned by the scheduler side.

`install(app, settings)` is called by `api.main.create_app`; it mounts the routes and wires the
hot-state store, the scheduler hooks and, in embedded mode, the in-process worker and beat
(see docs/contracts.md). The logic lives in `scheduler.protocol`; routes only translate.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI, Query, Request, Response
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import URL

from api import bulk_body
from api.deps import DeviceDep, check_device, principal_for
from api.schemas.common import parse_query
from api.schemas.work import UploadOut, WorkOut
from api.settings import Settings

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1", tags=["step protocol"])
OCTETS = "application/octet-stream"


def _error(exc: Any) -> JSONResponse:
    headers = {"Retry-After": "1"} if exc.status == 503 else None
    return JSONResponse({"detail": exc.detail}, status_code=exc.status, headers=headers)


MAX_WAIT_S = 30.0


@router.get("/devices/{device_id}/work", response_model=WorkOut)
async def work(device_id: str, request: Request, principal: DeviceDep,
               wait: float = Query(0.0, ge=0.0, le=MAX_WAIT_S)):
    """Long poll: answers as soon as the device has shards to compute, or after `wait` s.
    Served by `api.fast_path.FastPath` ahead of this route, through `work_reply`."""
    return await long_poll_work(request.app.state, device_id, wait, request.url)


class _WorkQuery(BaseModel):
    wait: float = Field(0.0, ge=0.0, le=MAX_WAIT_S)


async def work_reply(state: Any, device_id: str, authorization: str | None,
                     scope: dict[str, Any]) -> bytes:
    """The route above without FastAPI: the same token rule (DeviceDep), the same 422 for a
    bad `wait`, the same answer through the same response model."""
    check_device(await principal_for(state.authenticator, authorization), device_id)
    query = parse_query(_WorkQuery, scope["query_string"].decode("latin-1"))
    answer = await long_poll_work(state, device_id, query.wait, URL(scope=scope))
    return WorkOut.model_validate(answer).model_dump_json().encode()


async def long_poll_work(state: Any, device_id: str, wait: float, url: URL) -> dict[str, Any]:
    deadline = time.monotonic() + min(wait, state.settings.work_long_poll_max_s)
    while True:
        since = state.version_watch.snapshot()
        found = await run_in_threadpool(state.step_protocol.work, device_id)
        remaining = deadline - time.monotonic()
        if found is not None:
            return {"assignment": {**found, "bulk_url": _bulk_url(state, url)}}
        if remaining <= 0:
            return {"assignment": None}
        await state.version_watch.wait_change(since, remaining)


def _bulk_url(state: Any, url: URL) -> str | None:
    listener = getattr(state, "bulk_listener", None)
    return listener.url_for(url.scheme, url.hostname) if listener else None


@router.get("/jobs/{job_id}/weights")
async def weights(job_id: str, request: Request, principal: DeviceDep,
                  step: int = Query(..., ge=0)):
    status, payload = await run_in_threadpool(serve_weights, request.app.state,
                                              principal.device_id, job_id, step)
    if status != 200:
        headers = {"Retry-After": "1"} if status == 503 else None
        return JSONResponse(payload, status_code=status, headers=headers)
    return Response(payload, media_type=OCTETS, headers=WEIGHTS_HEADERS)


WEIGHTS_HEADERS = {"Cache-Control": "private, max-age=86400"}


def serve_weights(state: Any, device_id: str, job_id: str, step: int) -> tuple[int, Any]:
    """The weights message of step `step` -> (200, bytes) or (status, error answer); blocking."""
    from scheduler.protocol import ProtocolError, StateMissing

    try:
        return 200, state.step_protocol.weights(device_id, job_id, step)
    except StateMissing as exc:
        state.scheduler_hooks.job_changed(job_id)  # restore now, not at the next beat
        return exc.status, {"detail": exc.detail}
    except ProtocolError as exc:
        return exc.status, {"detail": exc.detail}


@router.get("/jobs/{job_id}/shards/{shard}/data")
async def shard_data(job_id: str, shard: int, request: Request, principal: DeviceDep):
    from scheduler.protocol import ProtocolError

    proto = request.app.state.step_protocol
    try:
        data = await run_in_threadpool(proto.shard_data, principal.device_id, job_id, shard)
    except ProtocolError as exc:
        return _error(exc)
    return Response(data, media_type=OCTETS)


@router.post("/jobs/{job_id}/steps/{step}/gradients", response_model=UploadOut)
async def upload_gradients(job_id: str, step: int, request: Request, principal: DeviceDep):
    """First upload of a shard wins; when the step's last shard arrives, apply_step is sent.
    The bulk listener (api.bulk_listener) answers the same on its own port."""
    body = await _whole_body(request)
    status, payload = await run_in_threadpool(accept_upload, request.app.state,
                                              principal.device_id, job_id, step, body)
    if status != 200:
        headers = {"Retry-After": "1"} if status == 503 else None
        return JSONResponse(payload, status_code=status, headers=headers)
    return payload


def accept_upload(state: Any, device_id: str, job_id: str, step: int,
                  body: bytes | memoryview) -> tuple[int, dict[str, Any]]:
    """One device's upload for step `step` of `job_id` -> (status, answer); blocking."""
    from scheduler.protocol import ProtocolError

    try:
        accepted, duplicates, complete = state.step_protocol.upload(device_id, job_id, step, body)
    except ProtocolError as exc:
        return exc.status, {"detail": exc.detail}
    if complete and accepted:
        state.scheduler_hooks.step_complete(job_id, step)
    return 200, {"accepted": accepted, "duplicates": duplicates}


async def _whole_body(request: Request) -> bytes:
    """The body without Starlette's final join, which copies even a body that came in one
    piece (api.bulk_body hands over gradient uploads whole)."""
    chunks = [chunk async for chunk in request.stream() if chunk]
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class SchedulerHooks:
    """The API's calls into the scheduler: enqueue only, never wait for a task."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx

    def job_changed(self, job_id: str) -> None:
        # the change is committed: step-protocol views cached under the old version go stale
        self._safely(self._bump)
        self._safely(self._reconcile)

    def device_changed(self, device_id: str) -> None:
        self._safely(self._reconcile)

    def step_complete(self, job_id: str, step: int) -> None:
        from scheduler.tasks.steps import enqueue_apply

        self._safely(lambda: enqueue_apply(self.ctx, job_id, step))

    def _bump(self) -> None:
        from scheduler.notify import bump_version

        bump_version(self.ctx.blobs)

    def _reconcile(self) -> None:
        from scheduler.tasks.reconcile import request_reconcile

        request_reconcile(self.ctx)

    @staticmethod
    def _safely(call: Any) -> None:
        # the change is committed; reconcile's next beat repairs a lost enqueue (broker down)
        try:
            call()
        except Exception:  # noqa: BLE001
            log.warning("could not enqueue a scheduler task", exc_info=True)


def is_gradient_upload(path: object) -> bool:
    return isinstance(path, str) and path.startswith("/v1/jobs/") and path.endswith("/gradients")


class _UploadPaths(tuple):
    """Paths that get the upload size limit: the control plane's, plus gradient uploads."""

    def __contains__(self, path: object) -> bool:
        return is_gradient_upload(path) or tuple.__contains__(self, path)


def _allow_big_gradients(app: FastAPI) -> None:
    from api.limits import BodySizeLimit

    for mw in app.user_middleware:
        if mw.cls is BodySizeLimit:
            mw.kwargs["upload_paths"] = _UploadPaths(mw.kwargs.get("upload_paths") or ())


def install(app: FastAPI, settings: Settings) -> None:
    """Mount the step-protocol routes on `app` and wire the scheduler into it."""
    from scheduler import celery_app, context
    from scheduler.blobs import blob_store_from_settings
    from scheduler.notify import VersionWatch
    from scheduler.protocol import StepProtocol

    app.state.celery = celery_app.configure(settings)
    blobs = blob_store_from_settings(settings)
    ctx = context.configure(settings, app.state.session_factory, blobs, app.state.clock)
    app.state.blobs = blobs
    app.state.step_protocol = StepProtocol(app.state.session_factory, blobs, settings.data_dir,
                                           app.state.clock)
    app.state.version_watch = VersionWatch.for_store(blobs, ctx.tuning.long_poll_interval_s)
    app.state.scheduler_hooks = SchedulerHooks(ctx)
    app.include_router(router)
    _allow_big_gradients(app)
    bulk_body.install(app, is_gradient_upload, settings.max_upload_bytes)
    if getattr(app.state, "start_scheduler", False):
        _run_embedded_scheduler(app)
    if settings.bulk_port is not None:
        _serve_bulk(app, settings)


def _serve_bulk(app: FastAPI, settings: Settings) -> None:
    """Wrap the app's lifespan: the bulk listener runs while the app serves. A port that
    cannot be bound is logged and skipped: agents then use the API port for everything."""
    from api.bulk_listener import BulkListener

    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a: FastAPI) -> AsyncIterator[Any]:
        listener = BulkListener(a.state, settings.bulk_host, int(settings.bulk_port or 0),
                                settings.max_upload_bytes, reuse_port=settings.bulk_reuse_port,
                                public_url=settings.bulk_public_url,
                                socket_buffer_bytes=settings.bulk_socket_buffer_bytes)
        a.state.bulk_listener = None
        try:
            listener.start()
            a.state.bulk_listener = listener
        except OSError as exc:
            log.warning("bulk port %s:%s not available (%s): weights and uploads go through "
                        "the API port only", settings.bulk_host, settings.bulk_port, exc)
        try:
            async with inner(a) as state:
                yield state
        finally:
            a.state.bulk_listener = None
            await run_in_threadpool(listener.stop)

    app.router.lifespan_context = lifespan


def _run_embedded_scheduler(app: FastAPI) -> None:
    """Wrap the app's lifespan: the in-process worker and beat run while the app serves."""
    from scheduler.embedded import EmbeddedScheduler

    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a: FastAPI) -> AsyncIterator[Any]:
        scheduler = EmbeddedScheduler(a.state.settings)
        await run_in_threadpool(scheduler.start)
        try:
            async with inner(a) as state:
                yield state
        finally:
            await run_in_threadpool(scheduler.stop)

    app.router.lifespan_context = lifespan
