"""The web app's composition: every service the control plane runs is built here, once, into a
typed `AppState`; the ASGI chain and the one lifespan (what runs while the app serves) are
written here, in order. Routes, the fast path and the listeners only use what this hands them.
The scheduler comes in as a factory of `api.scheduler_port.SchedulerPort` from the process's
composition root (`roots.api`): the API imports nothing of `scheduler`."""

from __future__ import annotations

import datetime as dt
import logging
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from functools import partial
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from fastapi_offline import FastAPIOffline
from sqlalchemy import Engine
from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp

from api import metrics
from api.app_state import AppState
from api.auth import Authenticator, ensure_admin_token
from api.body_auth import AuthBeforeBody
from api.error_responses import HANDLED, error_response
from api.fast_path import FastPath
from api.heartbeat_writer_pg import AsyncPgHeartbeatWriter
from api.heartbeats import HeartbeatWriter
from api.limits import BodySizeLimit, DeviceRate
from api.routes import agent_dist, datasets, devices, health, jobs, rollouts, tokens, ui, work
from api.scheduler_port import SchedulerFactory
from api.schemas.common import ERROR_MEANINGS
from api.steps.bulk_body import WholeBodyReader
from api.steps.bulk_listener import Bounds, BulkListener
from api.steps.handlers import carries_device_token, is_gradient_upload
from api.steps.peer_listener import PeerListener, advertised_host
from api.steps.protocol import StepProtocol
from domain import task_metrics
from domain.settings import Settings
from domain.store.db import make_engine, make_session_factory
from hotstate import keys
from hotstate.blobs import blob_store_for
from hotstate.version import VersionWatch

log = logging.getLogger(__name__)


def create_app(settings: Settings, clock: Callable[[], dt.datetime], *,
               scheduler: SchedulerFactory, start_scheduler: bool = False) -> FastAPI:
    """Build the control plane. `start_scheduler`: embedded mode's in-process worker and beat."""
    # /docs and /redoc with their scripts served from here: a lab network may be offline
    app = FastAPIOffline(title="Phalanx control plane", version="0.1.0", docs_url="/docs",
                         redoc_url="/redoc", openapi_url="/openapi.json",
                         generate_unique_id_function=operation_id,
                         lifespan=partial(_serving, settings=settings,
                                          start_scheduler=start_scheduler))
    app.state = _build_state(app, settings, clock, scheduler)  # type: ignore[assignment]
    _install_error_handlers(app)
    for module in (health, tokens, devices, jobs, datasets, agent_dist, rollouts, work, metrics,
                   ui):
        app.include_router(module.router)
    _asgi_chain(app, app.state, settings)  # type: ignore[arg-type]
    _document_errors(app)
    return app


def operation_id(route: APIRoute) -> str:
    """`listDevices`, `submitJob`: the handler's name in camelCase (client generators name
    their methods after it)."""
    first, *rest = route.name.split("_")
    return first + "".join(word.capitalize() for word in rest)


def _document_errors(app: FastAPI) -> None:
    """Add what every operation of a kind can answer to the OpenAPI document: 404 where the
    path names something, 413 where there is a body (the body-size limit)."""
    build = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        for path, operations in schema.get("paths", {}).items():
            for operation in operations.values():
                answers = operation.setdefault("responses", {})
                wanted = ([404] if "{" in path else []) + ([413] if "requestBody" in operation
                                                           else [])
                for code in wanted:
                    answers.setdefault(str(code), {
                        "description": ERROR_MEANINGS[code],
                        "content": {"application/json": {
                            "schema": {"$ref": "#/components/schemas/ErrorOut"}}}})
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def _build_state(app: FastAPI, settings: Settings, clock: Callable[[], dt.datetime],
                 scheduler: SchedulerFactory) -> AppState:
    engine = make_engine(settings.resolved_database_url)
    factory = make_session_factory(engine)
    admin = settings.admin_token.get_secret_value() if settings.admin_token else None
    if admin is None:
        ensure_admin_token(factory, settings.admin_token_file)
    blobs = blob_store_for(settings.redis_url)
    port = scheduler(settings, factory, blobs, clock)
    return AppState(
        settings=settings, clock=clock, engine=engine, session_factory=factory,
        authenticator=Authenticator(factory, admin, clock=clock),
        # through app.state, so a test may swap the scheduler after the app is built
        heartbeats=_heartbeat_writer(settings, engine, clock,
                                     lambda device_id: app.state.scheduler.device_changed(device_id)),
        blobs=blobs,
        step_protocol=StepProtocol(factory, blobs, settings.data_dir, clock),
        version_watch=VersionWatch.for_store(blobs, port.tuning.long_poll_interval_s),
        slices_watch=VersionWatch.for_store(blobs, port.tuning.long_poll_interval_s,
                                            keys.SLICES_VERSION),
        scheduler=port,
        heartbeat_rate=DeviceRate(settings.heartbeat_rate_per_minute, settings.heartbeat_burst,
                                  lambda: clock().timestamp()),
    )


def _heartbeat_writer(settings: Settings, engine: Engine, clock: Callable[[], dt.datetime],
                      changed: Callable[[str], None]) -> HeartbeatWriter | AsyncPgHeartbeatWriter:
    """Postgres: the asyncio group commit; SQLite: one writer thread (one writer at a time)."""
    options = {"clock": clock, "grace_s": settings.lease_grace_s,
               "interval_s": settings.heartbeat_interval_s, "on_device_changed": changed,
               "token_max_age_s": settings.device_token_max_age_s}
    if engine.dialect.name == "postgresql":
        return AsyncPgHeartbeatWriter(settings.resolved_database_url, engine, **options)
    return HeartbeatWriter(make_engine(settings.resolved_database_url), threads=1, **options)


def _install_error_handlers(app: FastAPI) -> None:
    async def _answer(_: Request, exc: Exception) -> JSONResponse:
        status, detail, headers = error_response(exc) or (500, "internal server error", {})
        return JSONResponse({"detail": detail}, status_code=status, headers=headers or None)

    for kind in HANDLED:
        app.add_exception_handler(kind, _answer)


class _UploadPaths(tuple):
    """Paths that get the upload size limit: dataset uploads (whole, or chunks of a resumable
    one), plus gradient uploads."""

    def __contains__(self, path: object) -> bool:
        return (is_gradient_upload(path) or tuple.__contains__(self, path)
                or (isinstance(path, str) and path.startswith("/v1/datasets/uploads/")))


def _asgi_chain(app: FastAPI, state: AppState, settings: Settings) -> None:
    """A request passes, outermost first: RequestMetrics (counts every answer, 500s included)
    -> AuthBeforeBody (a request with a body and no valid token: 401 before any of it is read)
    -> WholeBodyReader (a gradient upload's body, read only for a valid device token) ->
    FastPath (heartbeat and work long poll without FastAPI's routing) -> Starlette's
    ServerErrorMiddleware -> BodySizeLimit -> ExceptionMiddleware -> the routes."""
    app.add_middleware(BodySizeLimit, default_limit=settings.max_body_bytes,
                       upload_limit=settings.max_upload_bytes,
                       upload_paths=_UploadPaths(("/v1/datasets",)))
    starlette_stack = app.build_middleware_stack

    def build() -> ASGIApp:
        inner = FastPath(starlette_stack(), state, settings.max_body_bytes)
        inner = WholeBodyReader(inner, is_gradient_upload, settings.max_upload_bytes,
                                partial(carries_device_token, state))
        return metrics.RequestMetrics(AuthBeforeBody(inner, state.authenticator))

    app.build_middleware_stack = build  # type: ignore[method-assign]


@asynccontextmanager
async def _serving(app: FastAPI, *, settings: Settings,
                   start_scheduler: bool) -> AsyncIterator[None]:
    """What runs while the app serves, started in this order and stopped in the reverse: the
    peer port and this replica's applier (production), the bulk port, the embedded worker and
    beat; the heartbeat writer is flushed first at shutdown. A port that cannot be bound is
    logged and skipped (see each helper)."""
    state: AppState = app.state  # type: ignore[assignment]
    task_metrics.use_redis_url(settings.redis_url)
    metrics.watch_buffer_pool()
    async with AsyncExitStack() as stack:
        if not settings.embedded and settings.peer_port >= 0:
            await _serve_peers(stack, state, settings)
        if settings.bulk_port is not None:
            await _serve_bulk(stack, state, settings)
        if start_scheduler:
            stop = await run_in_threadpool(state.scheduler.run_embedded)
            stack.push_async_callback(_stop_within, stop, EMBEDDED_STOP_S)
        stack.push_async_callback(state.heartbeats.aclose)
        yield


# How long the server waits at shutdown for the embedded scheduler to stop (docs/cli.md,
# "Stopping"): its beat looks only at its next tick, up to reconcile_interval_s away, and its
# worker at its next poll. What has not stopped then ends with the process, as at a kill: in
# embedded mode the working state lives in the process and is lost at any stop (a job resumes
# from its checkpoint), and what reaches the database is written in transactions.
EMBEDDED_STOP_S = 1.0


async def _stop_within(stop: Callable[[], None], seconds: float) -> None:
    """Call `stop` in a thread of its own and wait `seconds` at most for it to return."""
    stopped = threading.Event()

    def run() -> None:
        try:
            stop()
        finally:
            stopped.set()

    threading.Thread(target=run, name="stopping", daemon=True).start()
    if not await run_in_threadpool(stopped.wait, seconds):
        log.info("still stopping after %.1f s: left to end with the process", seconds)


async def _serve_peers(stack: AsyncExitStack, state: AppState, settings: Settings) -> None:
    """The peer port serves upload bodies kept on this replica; without it (port taken) bodies
    go through Redis and the workers apply every step."""
    listener = PeerListener(advertised_host(settings.peer_host), settings.peer_port,
                            capacity_bytes=settings.peer_shelf_bytes)
    stack.push_async_callback(run_in_threadpool, listener.stop)
    try:
        listener.start()
    except OSError as exc:
        log.warning("peer port %s not available (%s): upload bodies go through Redis",
                    settings.peer_port, exc)
        return
    if settings.apply_on_replica:
        stack.push_async_callback(run_in_threadpool, state.scheduler.apply_here())


async def _serve_bulk(stack: AsyncExitStack, state: AppState, settings: Settings) -> None:
    """Without the bulk port (taken) agents use the API port for everything."""
    listener = BulkListener(state, settings.bulk_host, int(settings.bulk_port or 0),
                            settings.max_upload_bytes, reuse_port=settings.bulk_reuse_port,
                            public_url=settings.bulk_public_url,
                            socket_buffer_bytes=settings.bulk_socket_buffer_bytes,
                            bounds=Bounds(settings.bulk_max_connections,
                                          settings.bulk_header_timeout_s, settings.bulk_stall_s,
                                          settings.bulk_bodies_per_device),
                            tls=settings.tls_context())
    stack.push_async_callback(run_in_threadpool, listener.stop)
    try:
        listener.start()
    except OSError as exc:
        log.warning("bulk port %s:%s not available (%s): weights and uploads go through "
                    "the API port only", settings.bulk_host, settings.bulk_port, exc)
        return
    state.bulk_listener = listener
    stack.callback(setattr, state, "bulk_listener", None)
