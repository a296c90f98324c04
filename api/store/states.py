"""The states a job and a device can be in: defined here once, read by the store, the schemas,
the metrics and the scheduler. `str` enums, so a state compares equal to its stored string."""

from __future__ import annotations

from enum import Enum


class JobState(str, Enum):
    PENDING = "Pending"
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    CANCELLED = "Cancelled"


class DeviceState(str, Enum):
    READY = "Ready"
    NOT_READY = "NotReady"
    CORDONED = "Cordoned"
    DRAINING = "Draining"


JOB_STATES: tuple[str, ...] = tuple(s.value for s in JobState)
FINISHED_STATES: tuple[str, ...] = (JobState.SUCCEEDED.value, JobState.FAILED.value,
                                    JobState.CANCELLED.value)
DEVICE_STATES: tuple[str, ...] = tuple(s.value for s in DeviceState)
