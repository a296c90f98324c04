"""The one place the states of a job and of a device are named: `str` enums, so a state compares
equal to its stored string and to its JSON. In the wire format (stdlib only) so that the agent,
the clients, the pure placement policies and the store all import the same names; the
transitions between them are `domain.store.states`. No other module spells a state's string
(tests/test_architecture.py looks for one)."""

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
