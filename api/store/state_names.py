"""The names of the states a job and a device can be in: `str` enums, so a state compares
equal to its stored string. Apart from `api.store.states` (the transitions) so that the pure
placement policies can name states without importing the store."""

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
ACTIVE_STATES: tuple[str, ...] = (JobState.PENDING.value, JobState.RUNNING.value)
DEVICE_STATES: tuple[str, ...] = tuple(s.value for s in DeviceState)
