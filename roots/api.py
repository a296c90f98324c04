"""The API process's composition root: the web app (`api.main.create_app`) handed the
scheduler (`scheduler.bridge.SchedulerBridge`, whose context becomes the process's).
`uvicorn --factory roots.api:app_from_env`, `phalanx server` and the tests build apps here."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable

from fastapi import FastAPI

from api import main
from api.process import tune_interpreter
from domain.settings import Settings
from domain.store.models import utcnow
from scheduler.bridge import SchedulerBridge


def create_app(settings: Settings | None = None, clock: Callable[[], dt.datetime] | None = None,
               start_scheduler: bool = False) -> FastAPI:
    """The control plane. `start_scheduler`: embedded mode's in-process worker and beat."""
    return main.create_app(settings or Settings(), clock or utcnow,
                           scheduler=SchedulerBridge.for_app, start_scheduler=start_scheduler)


def app_from_env() -> FastAPI:
    """For `uvicorn --factory roots.api:app_from_env` (several worker processes)."""
    app = create_app()
    tune_interpreter(app.state.settings)
    return app
