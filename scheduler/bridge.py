"""The scheduler as the API sees it (`api.scheduler_port.SchedulerPort`, met structurally: the
scheduler imports nothing of the API). Built by the API process's composition root
(`roots.api`), which installs its context as the process's, so the tasks this process runs (a
replica's applies, embedded mode's worker threads) share the app's sessions, blobs and clock."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from domain.settings import Settings
from domain.tuning import Tuning
from hotstate.blobs import BlobStore
from hotstate.version import bump_version
from scheduler import context, plan
from scheduler.celery_app import broker_problem, configure
from scheduler.context import SchedulerContext
from scheduler.embedded import EmbeddedScheduler
from scheduler.local_apply import LocalApplier
from scheduler.tasks.reconcile import request_reconcile
from scheduler.tasks.steps import enqueue_apply

log = logging.getLogger(__name__)


class SchedulerBridge:
    def __init__(self, ctx: SchedulerContext) -> None:
        self.ctx = ctx
        self.tuning: Tuning = ctx.tuning
        self.celery = configure(ctx.settings)
        self._local: LocalApplier | None = None  # set while this replica applies its steps

    @classmethod
    def for_app(cls, settings: Settings, session_factory: sessionmaker[Session],
                blobs: BlobStore, clock: Callable[[], dt.datetime]) -> SchedulerBridge:
        """The API process's scheduler: its context becomes the process's."""
        ctx = SchedulerContext(settings, session_factory, blobs, clock)
        context.install(lambda: ctx)
        return cls(ctx)

    def job_changed(self, job_id: str) -> None:
        # the change is committed: step-protocol views cached under the old version go stale
        self._safely(lambda: bump_version(self.ctx.blobs))
        self._safely(lambda: request_reconcile(self.ctx))

    def device_changed(self, device_id: str) -> None:
        self._safely(lambda: request_reconcile(self.ctx))

    def step_complete(self, job_id: str, step: int) -> None:
        here = self._local.submit if self._local is not None else None
        self._safely(lambda: enqueue_apply(self.ctx, job_id, step, here=here))

    def eligibility(self, session: Session, spec: dict[str, Any],
                    memory_bytes: int | None) -> dict[str, Any]:
        return plan.eligibility(session, plan.request_for(spec, memory_bytes))

    def refusal(self, session: Session, spec: dict[str, Any],
                memory_bytes: int | None) -> str | None:
        return plan.refusal(session, plan.request_for(spec, memory_bytes))

    def broker_problem(self, timeout_s: float) -> str | None:
        problem = broker_problem(self.celery, timeout_s=timeout_s)
        if problem is None:
            return None
        log.warning("broker: %s", problem.detail)
        return problem.public

    def run_embedded(self) -> Callable[[], None]:
        scheduler = EmbeddedScheduler(self.ctx.settings)
        scheduler.start()
        return scheduler.stop

    def apply_here(self) -> Callable[[], None]:
        local = LocalApplier()
        self._local = local

        def stop() -> None:
            self._local = None
            local.stop()
        return stop

    @staticmethod
    def _safely(call: Callable[[], object]) -> None:
        # the change is committed; reconcile's next beat repairs a lost enqueue (broker down)
        try:
            call()
        except Exception:  # noqa: BLE001
            log.warning("could not enqueue a scheduler task", exc_info=True)
