"""What the API asks of the scheduler, as a Protocol. The API imports nothing of `scheduler`:
the process's composition root (`roots.api`) hands `api.main.create_app` a factory of one
(`scheduler.bridge.SchedulerBridge`). Enqueueing never waits for a task; the dry run's plan
runs the placement filters on the caller's session; the rest starts the scheduler's threads
this process runs."""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable
from typing import Any, Protocol

from sqlalchemy.orm import Session, sessionmaker

from domain.settings import Settings
from domain.tuning import Tuning
from hotstate.blobs import BlobStore

Stop = Callable[[], None]


class SchedulerPort(Protocol):
    tuning: Tuning

    def job_changed(self, job_id: str) -> None:
        """A job was created, cancelled or changed (committed): reconcile it soon."""

    def device_changed(self, device_id: str) -> None:
        """A device's facts changed (committed): reconcile soon."""

    def step_complete(self, job_id: str, step: int) -> None:
        """Every shard of the step is stored: apply it (once per claim)."""

    def eligibility(self, session: Session, spec: dict[str, Any],
                    memory_bytes: int | None) -> dict[str, Any]:
        """Every device through the placement filters (a dry run's answer)."""

    def refusal(self, session: Session, spec: dict[str, Any],
                memory_bytes: int | None) -> str | None:
        """Why no phone of the fleet could ever hold the job, or None."""

    def broker_problem(self, timeout_s: float) -> str | None:
        """Why tasks cannot be sent now, in words for anyone (/readyz), or None."""

    def run_embedded(self) -> Stop:
        """Embedded mode: a worker and beat as threads of this process until stopped."""

    def apply_here(self) -> Stop:
        """This replica applies the steps it completes (one thread) until stopped."""


# (settings, session factory, blob store, clock) -> the port, built once per app
SchedulerFactory = Callable[[Settings, sessionmaker[Session], BlobStore,
                             Callable[[], dt.datetime]], SchedulerPort]
