"""The app factory: wiring, exception handlers, the body-size limit (see docs/contracts.md)."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy import Engine
from sqlalchemy.exc import IntegrityError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from api.auth import Authenticator, ensure_admin_token
from api.errors import ApiError
from api.heartbeats import HeartbeatWriter
from api.limits import BodySizeLimit
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


def _validation_detail(exc: RequestValidationError) -> list[dict[str, Any]]:
    """FastAPI's shape (loc, msg, type) plus `field`, and nothing unserialisable."""
    detail = []
    for err in exc.errors():
        loc = [str(part) for part in err.get("loc", ())]
        field = ".".join(loc[1:]) if loc and loc[0] in ("body", "query", "path") else ".".join(loc)
        msg = str(err.get("msg", ""))
        if err.get("type") == "json_invalid":  # loc holds a character position, not a field
            field, msg = "", f"malformed JSON body: {err.get('ctx', {}).get('error', msg)}"
        detail.append({"loc": loc, "field": field, "msg": msg, "type": str(err.get("type", ""))})
    return detail


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": _validation_detail(exc)}, status_code=422)

    @app.exception_handler(IntegrityError)
    async def _integrity(_: Request, exc: IntegrityError) -> JSONResponse:
        log.info("integrity error: %s", exc)
        return JSONResponse({"detail": "conflicts with stored data (it changed concurrently "
                             "or already exists)"}, status_code=409)

    @app.exception_handler(OperationalError)
    async def _db_down(_: Request, exc: OperationalError) -> JSONResponse:
        log.warning("database error: %s", exc)
        return JSONResponse({"detail": "database unavailable, retry later"}, status_code=503,
                            headers={"Retry-After": "1"})

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse({"detail": exc.detail}, status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))


def _include_routers(app: FastAPI) -> None:
    from api import metrics
    from api.routes import agent_dist, datasets, devices, health, jobs, tokens

    for module in (health, tokens, devices, jobs, datasets, agent_dist):
        app.include_router(module.router)
    if hasattr(metrics, "router"):
        app.include_router(metrics.router)


def _writer_engine(url: str) -> Engine:
    """The heartbeat writers' own small pool. Postgres: AUTOCOMMIT (a batch is one statement)
    and no pre-ping round trip (a dead connection fails its batch, which is retried)."""
    if url.startswith("sqlite"):
        return make_engine(url)
    return make_engine(url, pool_pre_ping=False, pool_size=4, max_overflow=2,
                       isolation_level="AUTOCOMMIT")


def create_app(settings: Settings | None = None, clock: Callable[[], dt.datetime] | None = None,
               start_scheduler: bool = False) -> FastAPI:
    """Build the control plane. `start_scheduler` (embedded mode) is honoured by work.install."""
    from api.routes import work

    settings = settings or Settings()
    clock = clock or utcnow
    engine = make_engine(settings.resolved_database_url)
    factory = make_session_factory(engine)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        app.state.heartbeats.stop()
        app.state.heartbeats.engine.dispose()

    app = FastAPI(title="Phalanx control plane", version="0.1.0", lifespan=lifespan,
                  docs_url="/docs", openapi_url="/openapi.json")
    app.state.settings, app.state.clock = settings, clock
    app.state.engine, app.state.session_factory = engine, factory
    app.state.start_scheduler = start_scheduler
    app.state.scheduler_hooks = NoopHooks()
    admin = settings.admin_token.get_secret_value() if settings.admin_token else None
    if admin is None:
        ensure_admin_token(factory)
    app.state.authenticator = Authenticator(factory, admin, clock=clock)
    app.state.heartbeats = HeartbeatWriter(
        _writer_engine(settings.resolved_database_url), clock=clock,
        grace_s=settings.lease_grace_s, threads=1 if engine.dialect.name == "sqlite" else 4,
        interval_s=settings.heartbeat_interval_s,
        on_device_changed=lambda device_id: app.state.scheduler_hooks.device_changed(device_id))
    app.add_middleware(BodySizeLimit, default_limit=settings.max_body_bytes,
                       upload_limit=settings.max_upload_bytes, upload_paths=("/v1/datasets",))
    install_error_handlers(app)
    _include_routers(app)
    work.install(app, settings)
    return app


def app_from_env() -> FastAPI:
    """For `uvicorn --factory api.main:app_from_env` (several worker processes)."""
    import os
    import sys
    if os.environ.get("SWI"):
        sys.setswitchinterval(float(os.environ["SWI"]))
    return create_app()
