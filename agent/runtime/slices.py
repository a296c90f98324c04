"""A sliced job's weights on the phone (engine.slices): each slice is its own message, fetched
side by side (a replica serves each; several connections fill a phone's link better than one),
and the next step's slices are fetched ahead, each as soon as the server has applied it, while
the others are still being applied (issue 21 item 4).

A slice fetched ahead names the state it belongs to (the server's `X-Phalanx-State`); it is used
only when the step's assignment names that same state. A plan the server abandoned (a lost
upload made it plan the step again) names another state, so its slices are fetched again.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from agent.client import Client, ClientError, Conflict
from wire.assignment import Assignment
from wire.messages import join_weights

log = logging.getLogger(__name__)

AHEAD_WAIT_S = 10.0  # one ask for a slice of the next step waits this long for its apply
AHEAD_ASKS = 3  # then gives up: the assignment of the next step fetches what is missing
FETCHERS = 4  # slices fetched at once


class SliceFetcher:
    def __init__(self, client: Client) -> None:
        self.client = client
        self._lock = threading.Lock()
        self._ahead: dict[tuple[str, int, int], tuple[str | None, bytes]] = {}
        self._thread: threading.Thread | None = None  # the ahead fetcher, started on first use
        self._wake = threading.Condition()
        self._wanted: tuple[str, int, int, int] | None = None  # (job, step, slices, generation)
        self._generation = 0  # moved by every stop: a fetch of an older one is dropped
        self._closed = False
        self._pool = ThreadPoolExecutor(FETCHERS, thread_name_prefix="slices")
        self.fetched_ahead = 0  # slices used from what was fetched ahead (for tests, metrics)

    def whole(self, a: Assignment, bulk: Any) -> list[memoryview]:
        """The step's whole weights message, in parts: its slices joined, those fetched ahead
        for the assigned state taken as they are, the others fetched now side by side through
        `bulk(call)` (the bulk port the assignment names, else the API port)."""
        job, step = a.job_id, a.step
        with self._lock:
            ready = {k: body for (j, t, k), (state, body) in self._ahead.items()
                     if j == job and t == step and state == a.state and state is not None}
            self._ahead = {}  # what was fetched ahead is for this step or no more use
        missing = [k for k in range(len(a.slices)) if k not in ready]
        got = self._pool.map(lambda k: bulk(lambda url, k=k: self.client.weights_slice(
            job, step, k, url)), missing)
        for k, (body, state) in zip(missing, got):
            if a.state is not None and state != a.state:  # restored meanwhile: ask again
                raise Conflict(409, f"slice {k} of {job} step {step} is of state {state}, "
                               f"the assignment of {a.state}", "weights")
            ready[k] = body
        self.fetched_ahead += len(a.slices) - len(missing)
        return join_weights(job, step, [ready[k] for k in range(len(a.slices))])

    def fetch_ahead(self, a: Assignment) -> None:
        """Start fetching step a.step + 1's slices, each once applied: in order, by one thread
        kept for it (a phone waits on one request at a time, over one kept connection)."""
        with self._wake:
            self._generation += 1
            self._wanted = (a.job_id, a.step + 1, len(a.slices), self._generation)
            self._wake.notify()
            if self._thread is None:
                self._thread = threading.Thread(target=self._ahead_worker, name="slices-ahead",
                                                daemon=True)
                self._thread.start()

    def _ahead_worker(self) -> None:
        while True:
            with self._wake:
                while self._wanted is None and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                wanted, self._wanted = self._wanted, None
            assert wanted is not None
            try:
                self._ahead_loop(*wanted)
            except Exception:  # noqa: BLE001 - the thread is kept: it must outlive one failure
                log.exception("fetching slices of %s step %d ahead failed", wanted[0], wanted[1])

    def _ahead_loop(self, job: str, step: int, slices: int, generation: int) -> None:
        for k in range(slices):
            for _ in range(AHEAD_ASKS):
                if generation != self._generation:
                    return  # stopped: the step's assignment came, or another step is wanted
                try:
                    body, state = self.client.weights_slice(job, step, k, wait_s=AHEAD_WAIT_S)
                except ClientError as exc:  # not applied within the wait, or the job moved on
                    log.debug("slice %d of %s step %d not fetched ahead: %s", k, job, step, exc)
                    continue
                with self._lock:
                    if generation != self._generation:
                        return  # the step's assignment came meanwhile: it fetches its own
                    self._ahead[(job, step, k)] = (state, body)
                break
            else:
                return  # the step is slow to apply or gone: the assignment fetches the rest

    def stop_ahead(self, keep: tuple[str, int] | None = None) -> None:
        """Stop fetching ahead, and let go of what was fetched for any (job, step) but `keep`
        (the step now assigned takes its slices in `whole`): slices of a step that never came
        (the job ended, or this phone left it) are a model's worth held for nothing."""
        with self._wake:
            with self._lock:
                self._generation += 1
                self._ahead = {key: got for key, got in self._ahead.items()
                               if keep is not None and key[:2] == keep}
            self._wanted = None

    def held_bytes(self) -> int:
        """Bytes of slices fetched ahead and not taken yet."""
        with self._lock:
            return sum(len(body) for _, body in self._ahead.values())

    def close(self) -> None:
        with self._wake:
            self._closed = True
            with self._lock:
                self._generation += 1
                self._ahead = {}
            self._wake.notify()
        self._pool.shutdown(wait=False, cancel_futures=True)
