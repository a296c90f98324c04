"""The work loop: long-poll for work, fetch inputs, compute shards, upload each result once."""

from __future__ import annotations

import errno
import json
import logging
import socket
import threading
import time
from typing import Any

from agent.client import (
    RETRYABLE,
    Backoff,
    Client,
    ClientError,
    Conflict,
    StatusError,
    TransportError,
    Unauthorized,
    revoked_message,
)
from agent.runtime import choice
from agent.runtime.cache import WorkCache
from agent.runtime.execution import ExecutionManager
from agent.runtime.executor import ComputeFailed, Diverged
from agent.runtime.guard import Limits
from agent.runtime.ledger import UploadLedger
from agent.runtime.monitor import Monitor
from agent.runtime.slices import SliceFetcher
from agent.runtime.state import AgentState
from engine.tree import next_blocks
from wire.assignment import Assignment

log = logging.getLogger(__name__)
CHUNK_TARGET_S = 2.0  # compute this long between guard checks and uploads
PAUSED_POLL_S = 2.0
HOLD_FACTOR = 1.5  # partials held up to this x the last pass's time (scheduler: late at 3x)
# a compute error (ComputeFailed) raised this many times running on the same step, the same
# each time, each in a fresh worker, is the job's: reported, and the job fails with it
COMPUTE_TRIES = 3


class WorkLoop:
    def __init__(self, client: Client, device_id: str, monitor: Monitor, state: AgentState,
                 cache: WorkCache, ledger: UploadLedger, execution: ExecutionManager,
                 shared_default: bool = False, wait_s: float = 30.0,
                 backoff: Backoff | None = None) -> None:
        self.client, self.device_id = client, device_id
        self.monitor, self.state, self.cache, self.ledger = monitor, state, cache, ledger
        self.execution, self.shared_default, self.wait_s = execution, shared_default, wait_s
        self.backoff = backoff or Backoff(base_s=1.0, cap_s=60.0)
        self.uploaded_shards = 0
        self.steps_done = 0
        self._per_shard_s: float | None = None
        self._pass_s: float | None = None  # the last whole pass over a step's shards
        self._job: str | None = None
        self._throttle_seen = 0
        self._use_bulk = True  # until the bulk port proves unreachable
        self.slices = SliceFetcher(client)  # a sliced job's weights (agent.runtime.slices)
        # the last compute error ((job, step, error), times running) until a step computes
        self._failed: tuple[tuple[str, int, str], int] | None = None

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set() and self.state.fatal is None:
            try:
                wait = self.once(stop)
                self.backoff.reset()
            except Unauthorized as exc:
                self.state.stop_for_good(revoked_message(exc))
                stop.set()
                return
            except RETRYABLE as exc:
                wait = self.backoff.delay()
                log.warning("work loop: %s; retry in %.1fs", exc, wait)
            except (StatusError, ClientError, ValueError, RuntimeError, OSError) as exc:
                wait = self.backoff.delay()
                log.error("work loop: %s", exc)
            if wait:
                stop.wait(wait)
        self.slices.close()
        self.execution.close()

    def once(self, stop: threading.Event) -> float:
        """One poll and what it asks for; returns how long to wait before the next."""
        if self.state.draining:
            return PAUSED_POLL_S
        polled = time.monotonic()
        a = self.client.work(self.device_id, self.wait_s)
        if stop.is_set():
            return 0.0  # stopped during the long poll: take nothing on
        if a is None:
            quick = time.monotonic() - polled < 0.5  # a server that does not hold the poll
            if not quick:  # a whole long poll without work: no step is coming soon
                self.slices.stop_ahead()
            return 1.0 if quick else 0.0
        self.state.working = True  # no agent upgrade while a step is in hand
        try:
            return self._work_on(a, stop)
        finally:
            self.state.working = False

    def _work_on(self, a: Assignment, stop: threading.Event) -> float:
        job, step = a.job_id, a.step
        self.slices.stop_ahead(keep=(job, step))  # taken below if it is of this state
        if job != self._job:
            self.cache.keep_only(job)
            self._job, self._per_shard_s, self._pass_s = job, None, None
        self.ledger.forget_job(job, keep_from_step=step)
        self.monitor.set_limits(Limits.from_job_spec(a.spec, self.shared_default))
        # the server's list is authoritative: a shard it lists again lost its result (the
        # replica holding the upload died, Redis restarted) and must be computed again
        todo = list(a.shards)
        again = [k for k in todo if self.ledger.uploaded(job, step, k)]
        if again:
            log.info("server lists shards %s of %s step %d again (their results were lost): "
                     "computing them again", again, job, step)
        if not todo:
            return 0.5  # everything of this step is in; wait for the next step
        share = list(todo)  # this pass's shards: the worker uploads each node of them filled
        began = time.monotonic()
        # hold partials no longer than a pass took last time (x 1.5): a phone running late
        # uploads what it has, so a straggler's backup covers only what it has not done
        hold_s = HOLD_FACTOR * self._pass_s if self._pass_s else float("inf")
        while todo and not stop.is_set():
            if self.monitor.pause() is not None:  # a reading at most max_age_s old
                return PAUSED_POLL_S  # the heartbeat reports why; the scheduler moves shards
            if self.state.draining or self.state.fatal:
                return 0.0
            first = todo == share
            chunk, todo = next_blocks(todo, self._chunk_size())
            last = not todo or time.monotonic() - began > hold_s
            if not self._compute_and_upload(a, job, step, chunk, share, last, first):
                return 0.0  # the step moved on: poll again at once
        self._pass_s = time.monotonic() - began
        self.steps_done += 1
        if a.slices and not stop.is_set():
            self.slices.fetch_ahead(a)  # the next step's slices, each once it is applied
        return 0.0

    def _chunk_size(self) -> int:
        """At most how many shards a request computes: about CHUNK_TARGET_S of compute (the
        first, to measure a shard, one); next_blocks cuts the request on aligned blocks, so
        what is computed together goes up as few partials (engine.tree)."""
        if not self._per_shard_s:
            return 1
        return max(1, int(CHUNK_TARGET_S / self._per_shard_s))

    def _request(self, a: Assignment, job: str, step: int, shards: list[int]) -> dict[str, Any]:
        if a.slices:  # a sliced job: one message a slice, side by side (and some ahead)
            weights = self.cache.weights(job, step, lambda: self.slices.whole(
                a, lambda call: self._bulk(a, call)))
        else:
            weights = self.cache.weights(job, step, lambda: self._bulk(
                a, lambda url: self.client.weights(job, step, url)))
        paths = {str(k): str(self.cache.shard(
                     job, k, lambda start, k=k: self.client.shard_data(job, k, start)))
                 for k in shards}
        self.cache.evict(job, keep=set(shards))
        return {"job_id": job, "step": step, "spec": a.spec, "n_train": a.n_train,
                "input_shape": a.input_shape, "num_classes": a.num_classes,
                "weights_path": str(weights), "pre_reduce": a.pre_reduce,
                "shards": paths, "out_path": str(self.cache.result_path(job, step))}

    def _bulk(self, a: Assignment, call: Any) -> Any:
        """`call(bulk_url)` through the bulk port the assignment names (weights down, gradients
        up), else, and for good once that port fails to answer, `call(None)`: the API port. An
        upload that reached the bulk port before the failure comes back as a duplicate."""
        bulk_url = a.bulk_url if self._use_bulk else None
        if bulk_url:
            try:
                return call(bulk_url)
            except TransportError as exc:
                if not _nothing_listens(exc):  # reset, cut off, busy: this call only
                    log.info("bulk port %s failed this time (%s): this request goes to the API "
                             "port", bulk_url, exc)
                    return call(None)
                log.warning("bulk port %s unreachable (%s): using the API port from now on",
                            bulk_url, exc)
                self._use_bulk = False
        return call(None)

    def _ensure_choice(self, a: Assignment, req: dict[str, Any]) -> None:
        spec = a.spec
        arch = str(spec.get("model", {}).get("arch", "?"))
        backend = choice.job_backend(spec)
        key = json.dumps([a.job_id, spec.get("model"), backend], sort_keys=True)
        throttled = self.monitor.throttle_events > self._throttle_seen
        self._throttle_seen = self.monitor.throttle_events
        requested = self.state.take_profile_request(arch)
        if self.execution.needs_profile(key, throttled, requested):
            first = dict(req, shards=dict([next(iter(req["shards"].items()))]))
            self.execution.profile(key, first, backend)
            self.state.set_profile(arch, self.execution.report())

    def _compute_and_upload(self, a: Assignment, job: str, step: int, shards: list[int],
                            share: list[int], last: bool = True, first: bool = True) -> bool:
        """Compute `shards` (part of this pass's `share` of the step) and upload what the
        worker hands back: with pre_reduce, the nodes of the share they fill, the rest held in
        the worker until a later request fills them (all of it on the `last`). A new profile
        (which restarts the worker: what it holds would be lost) is taken on a pass's first
        request only."""
        try:
            req = {**self._request(a, job, step, shards), "step_shards": share, "last": last}
        except Conflict:
            return False  # weights of another step: this step is already applied
        try:
            if first or not self.execution.ready():
                self._ensure_choice(a, req)  # profiling computes a shard too
            started = time.monotonic()
            reply = self.execution.step(req)
        except Diverged as exc:  # the same bits on any phone: no retry, the job fails
            log.error("%s step %d diverged (%s): reporting it", job, step, exc)
            self._report_failure(job, step, shards[0], str(exc))
            return False
        except ComputeFailed as exc:
            return self._compute_failed(job, step, shards, exc)
        self._failed = None
        self._per_shard_s = (time.monotonic() - started) / len(shards)
        if reply.get("held"):
            return True  # pre-added in the worker; goes up with a later request of the step
        out = self.cache.result_path(job, step)
        try:
            body = out.read_bytes()
            reply = self._bulk(a, lambda url: self.client.upload_gradients(job, step, body, url))
        except Conflict:
            log.info("step %d of %s already applied: result dropped", step, job)
            return False
        except StatusError as exc:
            if exc.status == 403:  # shards moved to another device meanwhile
                log.info("shards %s of %s moved away: result dropped", shards, job)
                return False
            raise
        finally:
            out.unlink(missing_ok=True)
        done = [int(k) for k in (reply.get("accepted") or []) + (reply.get("duplicates") or [])]
        self.ledger.record(job, step, done or shards)
        self.uploaded_shards += len(done or shards)
        return True

    def _compute_failed(self, job: str, step: int, shards: list[int],
                        exc: ComputeFailed) -> bool:
        """The engine raised on this step's inputs. Once may be the phone's moment (memory
        short while the user's apps hold it): the worker is replaced and the loop's backoff
        tries again, as after any worker failure. The same error on the same step
        COMPUTE_TRIES times running is the job's, which every phone would meet: reported,
        and the job fails with it instead of holding its phones for ever."""
        key = (job, step, str(exc))
        tries = self._failed[1] + 1 if self._failed and self._failed[0] == key else 1
        self._failed = (key, tries)
        self.execution.close()  # the next try starts a fresh worker (and profiles again)
        if tries < COMPUTE_TRIES:
            log.warning("%s step %d: the compute failed (%s), try %d of %d", job, step, exc,
                        tries, COMPUTE_TRIES)
            raise exc  # the loop's backoff, then the step again
        log.error("%s step %d: the compute failed the same way %d times (%s): reporting it",
                  job, step, tries, exc)
        self._report_failure(job, step, shards[0], f"shard {shards[0]} cannot be computed: "
                             f"{exc} (the same on {tries} tries)", "compute_error")
        self._failed = None  # reported (a report that failed is made at the next try)
        return False

    def _report_failure(self, job: str, step: int, shard: int, reason: str,
                        kind: str = "diverged") -> None:
        """The job's step has no result for `shard`, on any phone: the server fails the job."""
        try:
            self.client.report_diverged(job, step, shard, reason, kind)
        except StatusError as gone:
            if gone.status not in (403, 404, 409):
                raise  # a server error or a revoked token: the loop's backoff and rules
            log.info("failure report not taken (the job moved on): %s", gone)


def _nothing_listens(exc: BaseException) -> bool:
    """Whether a failed request found nothing at the address (refused, no route, unknown
    name): a port that will not answer. A reset or a timeout mid-request is a busy or
    restarting server, not a reason to leave its bulk port for good."""
    cause = exc.__cause__
    return isinstance(cause, (ConnectionRefusedError, socket.gaierror)) or (
        isinstance(cause, OSError) and cause.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH))
