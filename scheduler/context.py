"""What scheduler tasks run against in a process: settings, store sessions, hot state, clock.

Built by the process's composition root, never here: `roots.worker` for a worker process
(lazily, in the process that runs the tasks, so no connection crosses a fork), `roots.api` for
an API process (its replica's applier and embedded mode's worker threads share the app's
session factory, blob store and clock). A task asks `get_context()` for it.
"""

from __future__ import annotations

import datetime as dt
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from sqlalchemy.orm import Session, sessionmaker

from domain.settings import Settings
from domain.store.models import utcnow
from domain.tuning import Tuning
from hotstate.blobs import BlobStore
from scheduler.policy.quota import UserLimits


@dataclass
class SchedulerContext:
    settings: Settings
    session_factory: sessionmaker[Session]
    blobs: BlobStore
    clock: Callable[[], dt.datetime] = utcnow
    tuning: Tuning = field(default_factory=Tuning)

    @property
    def user_limits(self) -> UserLimits:
        return UserLimits(self.settings.user_max_running_jobs, self.settings.user_max_devices)


_lock = threading.Lock()
_build: Callable[[], SchedulerContext] | None = None
_context: SchedulerContext | None = None


def install(build: Callable[[], SchedulerContext]) -> None:
    """The process's context, made by `build` when a task first asks (a composition root's
    call; a later install replaces the earlier one)."""
    global _build, _context
    with _lock:
        _build, _context = build, None


def get_context() -> SchedulerContext:
    global _context
    if _context is not None:
        return _context
    with _lock:
        if _context is None:
            if _build is None:
                raise RuntimeError("no scheduler context in this process: start it through "
                                   "its composition root (roots.worker or roots.api)")
            _context = _build()
        return _context


def reset() -> None:
    """Forget the context (tests that build several apps in one process)."""
    global _build, _context
    with _lock:
        _build, _context = None, None
