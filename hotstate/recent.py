"""What this process's last apply of each job made: the state (the next apply reads it from
memory instead of the blob store: 25.7 MB of Redis GET per step for mobilenet_v1) and the weights
message (this process's API serves it as made, api.steps.protocol)."""

from __future__ import annotations

import threading

from engine.step import TrainState


class RecentStates:
    """The state each job's last apply_step in this process wrote, so the next one reads it
    from memory instead of the blob store (25.7 MB of Redis GET per step for mobilenet_v1).
    Trusted only while the blob store still holds that key: a store that lost it (a Redis
    restart) sends the job through the restore below exactly as without this cache."""

    def __init__(self, jobs: int = 16) -> None:
        self.jobs = jobs
        # job -> (state, its nonce: the name the commit gave it, its weights message)
        self._states: dict[str, tuple[TrainState, str | None, bytes | memoryview | None]] = {}
        self._lock = threading.Lock()

    def remember(self, job_id: str, state: TrainState, nonce: str | None,
                 weights: bytes | memoryview | None = None) -> None:
        """`nonce`: the one the commit named the state by; `weights`: the weights message of
        the same step, for the API of this process (a replica that applied the step serves it
        without a Redis GET)."""
        with self._lock:
            self._states.pop(job_id, None)
            self._states[job_id] = (state, nonce, weights)
            while len(self._states) > self.jobs:
                self._states.pop(next(iter(self._states)))

    def get(self, job_id: str, step: int, nonce: str | None) -> TrainState | None:
        """The state of `step` named `nonce`, if this process made it (a step reached again
        after a rewind is another state, under another nonce)."""
        with self._lock:
            state, made, _ = self._states.get(job_id, (None, None, None))
        return state if state is not None and state.step == step and made == nonce else None

    def weights(self, job_id: str, step: int, nonce: str | None) -> bytes | memoryview | None:
        with self._lock:
            state, made, weights = self._states.get(job_id, (None, None, None))
        ok = state is not None and state.step == step and made == nonce
        return weights if ok else None


RECENT = RecentStates()
# a sliced job's slices this process applied (under "<job>#s<k>": scheduler.tasks.recovery),
# apart, so a job of many slices does not push other jobs' states out of RECENT
RECENT_SLICES = RecentStates(jobs=64)
