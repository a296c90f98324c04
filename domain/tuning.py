"""The scheduler's knobs (`PHALANX_SCHED_*`), apart from the control plane's settings: read by
the scheduler's tasks and by the API's long polls, which wait on what the tasks publish."""

from __future__ import annotations

import os

from pydantic_settings import BaseSettings, SettingsConfigDict


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
