"""Liveness and readiness."""

from __future__ import annotations

import logging

import redis
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from sqlalchemy import text
from starlette.concurrency import run_in_threadpool

log = logging.getLogger(__name__)
router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process answers (no dependencies checked)."""
    return {"status": "ok"}


def _check(request: Request) -> dict[str, str]:
    """What does not work, by part. The answer names the part and the error's class only
    (anyone may ask /readyz); the full error goes to the log."""
    problems: dict[str, str] = {}
    try:
        with request.app.state.engine.connect() as conn:
            conn.execute(text("SELECT 1"))
    except Exception as exc:
        log.warning("readyz: database unreachable: %s", exc)
        problems["database"] = f"database unreachable ({type(exc).__name__})"
    redis_url = request.app.state.settings.redis_url
    if redis_url:
        try:
            client = redis.Redis.from_url(redis_url, socket_connect_timeout=1, socket_timeout=1)
            client.ping()
            client.close()
        except Exception as exc:
            log.warning("readyz: redis unreachable: %s", exc)
            problems["redis"] = f"redis unreachable ({type(exc).__name__})"
        # the broker apart from the blob store: its transport is a separate import that a
        # broken install lacks while redis-py itself works
        problem = request.app.state.scheduler.broker_problem(timeout_s=1.0)
        if problem is not None:
            problems["broker"] = problem
    return problems


@router.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    """The database (and Redis and the task broker, when configured) answer; 503 with the
    reason otherwise."""
    problems = await run_in_threadpool(_check, request)
    if problems:
        return JSONResponse({"detail": "; ".join(problems.values()), "checks": problems},
                            status_code=503)
    return JSONResponse({"status": "ready"})
