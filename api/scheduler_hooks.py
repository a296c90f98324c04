"""The API's calls into the scheduler: enqueue only, never wait for a task."""

from __future__ import annotations

import logging
from collections.abc import Callable

from hotstate.version import bump_version
from scheduler.context import SchedulerContext
from scheduler.local_apply import LocalApplier
from scheduler.tasks.reconcile import request_reconcile
from scheduler.tasks.steps import enqueue_apply

log = logging.getLogger(__name__)


class SchedulerHooks:
    def __init__(self, ctx: SchedulerContext) -> None:
        self.ctx = ctx
        self.local: LocalApplier | None = None  # set while this replica applies its steps

    def job_changed(self, job_id: str) -> None:
        # the change is committed: step-protocol views cached under the old version go stale
        self._safely(lambda: bump_version(self.ctx.blobs))
        self._safely(lambda: request_reconcile(self.ctx))

    def device_changed(self, device_id: str) -> None:
        self._safely(lambda: request_reconcile(self.ctx))

    def step_complete(self, job_id: str, step: int) -> None:
        here = self.local.submit if self.local is not None else None
        self._safely(lambda: enqueue_apply(self.ctx, job_id, step, here=here))

    @staticmethod
    def _safely(call: Callable[[], object]) -> None:
        # the change is committed; reconcile's next beat repairs a lost enqueue (broker down)
        try:
            call()
        except Exception:  # noqa: BLE001
            log.warning("could not enqueue a scheduler task", exc_info=True)
