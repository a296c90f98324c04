"""What scheduler tasks run against in this process: settings, store sessions, hot state, clock.

A worker process builds it lazily from `PHALANX_*` variables. In embedded mode the API calls
`configure(...)` first, so the in-process worker threads share the app's session factory, blob
store and clock.
"""

from __future__ import annotations

import datetime as dt
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy.orm import Session, sessionmaker

from domain.settings import Settings, get_settings
from domain.store.db import make_engine, make_session_factory
from domain.store.models import utcnow
from hotstate.blobs import BlobStore, blob_store_for
from scheduler.policy.quota import UserLimits


class Tuning(BaseSettings):
    """Scheduler knobs (`PHALANX_SCHED_*`), apart from the control plane's settings."""

    model_config = SettingsConfigDict(env_prefix="PHALANX_SCHED_", extra="ignore")

    straggler_floor_s: float = 2.0  # never call a device late sooner than this
    straggler_factor: float = 3.0  # late = factor x the job's typical step time
    apply_claim_ttl_s: float = 15.0  # an enqueued apply_step not done by then is re-enqueued
    lock_ttl_s: float = 30.0  # placement lock lease (a dead holder frees it by then)
    long_poll_interval_s: float = 0.005  # how often a waiting API process checks the version key
    eviction_window_s: float = 60.0
    # threads that share apply_step's sum + update (element-wise: the same bits for any count)
    apply_threads: int = min(4, os.cpu_count() or 1)
    # a sliced job's slices all applied by the task that starts the step, one after another,
    # instead of sent to the workers (tests that call the tasks directly)
    slices_inline: bool = False
    # tests only: sleep between writing state t+1 and committing step t+1 (the crash window)
    apply_pause_s: float = 0.0


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
_context: SchedulerContext | None = None


def configure(
    settings: Settings,
    session_factory: sessionmaker[Session] | None = None,
    blobs: BlobStore | None = None,
    clock: Callable[[], dt.datetime] | None = None,
) -> SchedulerContext:
    global _context
    with _lock:
        if session_factory is None:
            session_factory = make_session_factory(make_engine(settings.resolved_database_url))
        _context = SchedulerContext(
            settings=settings,
            session_factory=session_factory,
            blobs=blobs or blob_store_for(settings.redis_url),
            clock=clock or utcnow,
        )
        return _context


def get_context() -> SchedulerContext:
    if _context is None:
        return configure(get_settings())
    return _context


def reset() -> None:
    """Forget the context (tests that build several apps in one process)."""
    global _context
    with _lock:
        _context = None
