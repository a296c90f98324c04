"""Steps applied by the API replica that received the upload completing them (production).

The replica keeps the step's upload bodies (hotstate.bodies), so applying there reads them from
its own memory, and the weights message it makes is served by the same process without a Redis
GET. What the replica does not hold it reads from the other replicas' peer ports, as a worker
would. Measured at 8 agents (docs/benchmarks.md): about a third of a step less than sending the
task to a separate worker, which must first fetch every body.

It is the same task (scheduler.tasks.steps.apply_step) run in one thread of this process, under
the same claim: if the replica dies or the apply fails, the claim expires and reconcile sends
the step to the Celery workers (`steps` queue), and the guarded commit applies it once whoever
runs it. `PHALANX_APPLY_ON_REPLICA=false` sends every step to the workers.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from scheduler.tasks.steps import apply_step

log = logging.getLogger(__name__)


class LocalApplier:
    """One thread: a replica applies its steps one after another (a job's steps are sequential,
    and several jobs' applies would only contend for the same cores)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="local-apply")

    def submit(self, job_id: str, step: int) -> None:
        self._pool.submit(self._run, job_id, step)

    @staticmethod
    def _run(job_id: str, step: int) -> None:
        try:
            apply_step(job_id, step)  # the task's body, called in this thread
        except Exception:  # noqa: BLE001 - the claim expires and a worker applies it
            log.exception("applying step %s of %s here failed; a worker will", step, job_id)

    def stop(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
