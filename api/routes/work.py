"""The step protocol (work, weights, shard data, gradient uploads): owned by the scheduler side.

`install(app, settings)` is called by `api.main.create_app`; it mounts the routes and wires the
hot-state store, the scheduler hooks and, in embedded mode, the in-process worker and beat
(see docs/contracts.md). The logic lives in `api.steps.protocol`; routes only translate.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

from fastapi import APIRouter, FastAPI, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from api.deps import DeviceDep
from api.limits import BodySizeLimit
from api.schemas.work import UploadOut, WorkOut
from api.settings import Settings
from api.steps import bulk_body
from api.steps.bulk_listener import Bounds, BulkListener
from api.steps.handlers import (
    MAX_WAIT_S,
    WEIGHTS_HEADERS,
    SchedulerHooks,
    accept_upload,
    carries_device_token,
    is_gradient_upload,
    long_poll_work,
    serve_weights,
)
from api.steps.peer_listener import PeerListener, advertised_host
from api.steps.protocol import StepProtocol
from hotstate.blobs import blob_store_for
from hotstate.version import VersionWatch
from scheduler import celery_app, context
from scheduler.embedded import EmbeddedScheduler
from scheduler.local_apply import LocalApplier

log = logging.getLogger(__name__)
router = APIRouter(prefix="/v1", tags=["step protocol"])
OCTETS = "application/octet-stream"


@router.get("/devices/{device_id}/work", response_model=WorkOut)
async def work(device_id: str, request: Request, principal: DeviceDep,
               wait: float = Query(0.0, ge=0.0, le=MAX_WAIT_S)):
    """Long poll: answers as soon as the device has shards to compute, or after `wait` s.
    Served by `api.fast_path.FastPath` ahead of this route, through `api.steps.handlers.work_reply`."""
    return await long_poll_work(request.app.state, device_id, wait, request.url)


@router.get("/jobs/{job_id}/weights")
async def weights(job_id: str, request: Request, principal: DeviceDep,
                  step: int = Query(..., ge=0)):
    payload = await run_in_threadpool(serve_weights, request.app.state, principal.device_id,
                                      job_id, step)
    return Response(payload, media_type=OCTETS, headers=WEIGHTS_HEADERS)


@router.get("/jobs/{job_id}/shards/{shard}/data")
async def shard_data(job_id: str, shard: int, request: Request, principal: DeviceDep):
    proto = request.app.state.step_protocol
    data = await run_in_threadpool(proto.shard_data, principal.device_id, job_id, shard)
    return Response(data, media_type=OCTETS)


@router.post("/jobs/{job_id}/steps/{step}/gradients", response_model=UploadOut)
async def upload_gradients(job_id: str, step: int, request: Request, principal: DeviceDep):
    """First upload of a shard wins; when the step's last shard arrives, apply_step is sent.
    The bulk listener (api.steps.bulk_listener) answers the same on its own port."""
    body = await _whole_body(request)
    return await run_in_threadpool(accept_upload, request.app.state, principal.device_id,
                                   job_id, step, body)


async def _whole_body(request: Request) -> bytes:
    """The body without Starlette's final join, which copies even a body that came in one
    piece (api.steps.bulk_body hands over gradient uploads whole)."""
    chunks = [chunk async for chunk in request.stream() if chunk]
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


class _UploadPaths(tuple):
    """Paths that get the upload size limit: the control plane's, plus gradient uploads."""

    def __contains__(self, path: object) -> bool:
        return is_gradient_upload(path) or tuple.__contains__(self, path)


def _allow_big_gradients(app: FastAPI) -> None:
    for mw in app.user_middleware:
        if mw.cls is BodySizeLimit:
            mw.kwargs["upload_paths"] = _UploadPaths(mw.kwargs.get("upload_paths") or ())


def install(app: FastAPI, settings: Settings) -> None:
    """Mount the step-protocol routes on `app` and wire the scheduler into it."""
    app.state.celery = celery_app.configure(settings)
    blobs = blob_store_for(settings.redis_url)
    ctx = context.configure(settings, app.state.session_factory, blobs, app.state.clock)
    app.state.blobs = blobs
    app.state.step_protocol = StepProtocol(app.state.session_factory, blobs, settings.data_dir,
                                           app.state.clock)
    app.state.version_watch = VersionWatch.for_store(blobs, ctx.tuning.long_poll_interval_s)
    app.state.scheduler_hooks = SchedulerHooks(ctx)
    app.include_router(router)
    _allow_big_gradients(app)
    bulk_body.install(app, is_gradient_upload, settings.max_upload_bytes,
                      partial(carries_device_token, app.state))
    if getattr(app.state, "start_scheduler", False):
        _run_embedded_scheduler(app)
    if settings.bulk_port is not None:
        _serve_bulk(app, settings)
    if not settings.embedded and settings.peer_port >= 0:
        _serve_peers(app, settings)


def _serve_peers(app: FastAPI, settings: Settings) -> None:
    """Wrap the app's lifespan: the peer port (and this replica's applier of the steps it
    completes) runs while the app serves. A port that cannot be bound is logged and skipped:
    upload bodies then go through Redis, and the workers apply every step."""
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a: FastAPI) -> AsyncIterator[Any]:
        listener = PeerListener(advertised_host(settings.peer_host), settings.peer_port,
                                capacity_bytes=settings.peer_shelf_bytes)
        local = LocalApplier() if settings.apply_on_replica else None
        try:
            listener.start()
            a.state.scheduler_hooks.local = local
        except OSError as exc:
            log.warning("peer port %s not available (%s): upload bodies go through Redis",
                        settings.peer_port, exc)
        try:
            async with inner(a) as state:
                yield state
        finally:
            a.state.scheduler_hooks.local = None
            if local is not None:
                await run_in_threadpool(local.stop)
            await run_in_threadpool(listener.stop)

    app.router.lifespan_context = lifespan


def _serve_bulk(app: FastAPI, settings: Settings) -> None:
    """Wrap the app's lifespan: the bulk listener runs while the app serves. A port that
    cannot be bound is logged and skipped: agents then use the API port for everything."""
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(a: FastAPI) -> AsyncIterator[Any]:
        listener = BulkListener(a.state, settings.bulk_host, int(settings.bulk_port or 0),
                                settings.max_upload_bytes, reuse_port=settings.bulk_reuse_port,
                                public_url=settings.bulk_public_url,
                                socket_buffer_bytes=settings.bulk_socket_buffer_bytes,
                                bounds=Bounds(settings.bulk_max_connections,
                                              settings.bulk_header_timeout_s,
                                              settings.bulk_stall_s,
                                              settings.bulk_bodies_per_device))
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
