"""The worker process's composition root: the Celery app pointed at the settings, and the
context its tasks run against (`scheduler.context`), built from the same settings in the
process that runs them (lazily: nothing is connected before a fork).
`celery -A roots.worker worker|beat|inspect` and `phalanx worker` start here."""

from __future__ import annotations

from celery import Celery

from domain.settings import Settings, get_settings
from domain.store.db import make_engine, make_session_factory
from hotstate.blobs import blob_store_for
from scheduler import celery_app, context
from scheduler.context import SchedulerContext


def build_context(settings: Settings) -> SchedulerContext:
    session_factory = make_session_factory(make_engine(settings.resolved_database_url))
    return SchedulerContext(settings, session_factory, blob_store_for(settings.redis_url))


def install(settings: Settings) -> Celery:
    """This process runs scheduler tasks with `settings`: the broker and the context."""
    context.install(lambda: build_context(settings))
    return celery_app.configure(settings)


app = install(get_settings())
