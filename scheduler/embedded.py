"""Embedded mode: Celery worker and beat as threads inside `phalanx server` (no Redis).

Same tasks, same code path as production: tasks go through Celery's in-memory transport
(woken by each message, see scheduler.memory_broker) to one worker consuming both queues with
a small thread pool, so a long placement pass on `control` never holds up a step on `steps`.
(One worker: Celery keeps the selected queues on the app, so two workers in one process would
share them.)
"""

from __future__ import annotations

import logging
import threading

from celery.beat import EmbeddedService, Scheduler
from celery.worker import WorkController
from celery.worker import state as worker_state

from domain.settings import Settings
from scheduler.celery_app import CONTROL, STEPS, app

log = logging.getLogger(__name__)


class EmbeddedScheduler:
    def __init__(self, settings: Settings, queues: tuple[str, ...] = (CONTROL, STEPS),
                 beat: bool = True, concurrency: int = 3) -> None:
        self.settings, self.queues, self.beat = settings, queues, beat
        self.concurrency = concurrency
        self._workers: list[tuple[WorkController, threading.Thread]] = []
        self._beat: EmbeddedService | None = None

    def start(self) -> None:
        app.loader.import_default_modules()
        app.finalize()
        worker = WorkController(
            app=app, hostname="embedded@phalanx", pool="threads", concurrency=self.concurrency,
            queues=list(self.queues), loglevel="WARNING", without_heartbeat=True,
            without_mingle=True, without_gossip=True, ready_callback=None,
        )
        thread = threading.Thread(target=worker.start, name="celery-worker", daemon=True)
        thread.start()
        self._workers.append((worker, thread))
        if self.beat:
            self._beat = EmbeddedService(app, thread=True, scheduler_cls=Scheduler)
            self._beat.start()
        log.info("embedded scheduler started: queues %s, beat %s", self.queues, self.beat)

    def stop(self, timeout: float = 10.0) -> None:
        if self._beat is not None:
            self._beat.stop()
        worker_state.should_terminate = 0  # the solo workers' loops exit at their next poll
        for worker, thread in self._workers:
            try:
                worker.stop(in_sighandler=False)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                log.debug("worker stop", exc_info=True)
            thread.join(timeout)
        worker_state.should_terminate = None
        self._workers.clear()
