"""The app factory: wiring, exception handlers, the body-size limit (see docs/contracts.md)."""

from __future__ import annotations

import datetime as dt
import logging
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from sqlalchemy import Engine

from api import fast_path, metrics
from api.auth import Authenticator, ensure_admin_token
from api.error_responses import HANDLED, error_response
from api.heartbeat_writer_pg import AsyncPgHeartbeatWriter
from api.heartbeats import HeartbeatWriter
from api.limits import BodySizeLimit
from api.routes import agent_dist, datasets, devices, health, jobs, tokens, work
from api.settings import Settings
from api.store.db import make_engine, make_session_factory
from api.store.models import utcnow

log = logging.getLogger(__name__)


class NoopHooks:
    """Default scheduler hooks; `api.routes.work.install` replaces them."""

    def job_changed(self, job_id: str) -> None:
        pass

    def device_changed(self, device_id: str) -> None:
        pass


def install_error_handlers(app: FastAPI) -> None:
    async def _answer(_: Request, exc: Exception) -> JSONResponse:
        status, detail, headers = error_response(exc) or (500, "internal server error", {})
        return JSONResponse({"detail": detail}, status_code=status, headers=headers or None)

    for kind in HANDLED:
        app.add_exception_handler(kind, _answer)


def _include_routers(app: FastAPI) -> None:
    for module in (health, tokens, devices, jobs, datasets, agent_dist):
        app.include_router(module.router)
    if hasattr(metrics, "router"):
        app.include_router(metrics.router)


def _heartbeat_writer(app: FastAPI, settings: Settings, engine: Engine, clock: Callable) -> Any:
    """Postgres: the asyncio group commit; SQLite: one writer thread (one writer at a time)."""
    def changed(device_id: str) -> None:
        app.state.scheduler_hooks.device_changed(device_id)

    options = {"clock": clock, "grace_s": settings.lease_grace_s,
               "interval_s": settings.heartbeat_interval_s, "on_device_changed": changed}
    if engine.dialect.name == "postgresql":
        return AsyncPgHeartbeatWriter(settings.resolved_database_url, engine, **options)
    return HeartbeatWriter(make_engine(settings.resolved_database_url), threads=1, **options)


def create_app(settings: Settings | None = None, clock: Callable[[], dt.datetime] | None = None,
               start_scheduler: bool = False) -> FastAPI:
    """Build the control plane. `start_scheduler` (embedded mode) is honoured by work.install."""
    settings = settings or Settings()
    clock = clock or utcnow
    engine = make_engine(settings.resolved_database_url)
    factory = make_session_factory(engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await app.state.heartbeats.aclose()

    app = FastAPI(title="Phalanx control plane", version="0.1.0", lifespan=lifespan,
                  docs_url="/docs", openapi_url="/openapi.json")
    app.state.settings, app.state.clock = settings, clock
    app.state.engine, app.state.session_factory = engine, factory
    app.state.start_scheduler = start_scheduler
    app.state.scheduler_hooks = NoopHooks()
    admin = settings.admin_token.get_secret_value() if settings.admin_token else None
    if admin is None:
        ensure_admin_token(factory, settings.admin_token_file)
    app.state.authenticator = Authenticator(factory, admin, clock=clock)
    app.state.heartbeats = _heartbeat_writer(app, settings, engine, clock)
    app.add_middleware(BodySizeLimit, default_limit=settings.max_body_bytes,
                       upload_limit=settings.max_upload_bytes, upload_paths=("/v1/datasets",))
    install_error_handlers(app)
    _include_routers(app)
    fast_path.install(app, body_limit=settings.max_body_bytes)
    work.install(app, settings)
    return app


def app_from_env() -> FastAPI:
    """For `uvicorn --factory api.main:app_from_env` (several worker processes)."""
    app = create_app()
    tune_interpreter(app.state.settings)
    return app


def tune_interpreter(settings: Settings) -> None:
    """Process-wide settings for a serving process (not for tests that build apps): a GIL
    switch interval of 1 ms instead of 5 took the 8-agent coordination benchmark's step from
    135-140 to 118-129 ms (docs/benchmarks.md): an I/O thread that wants the GIL back after a
    socket call waits for a Python-busy thread at most that long."""
    sys.setswitchinterval(settings.gil_switch_interval_s)
