"""The step protocol's logic behind `api/routes/work.py` (sync; routes run it in a thread).

Reads are cheap on purpose: every device's holdings and their jobs' rows are read once per value
of the version key, for all devices at once (`Holdings`), so a step's work, weights and upload
requests cost no query after the first; what is already uploaded comes from key listings in
the blob store.
"""

from __future__ import annotations

import datetime as dt
import io
import math
import threading
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from domain.errors import Conflict, Forbidden, Invalid, NotFound, Unavailable, Unprocessable
from domain.store.jobs import fail_diverged
from domain.store.models import Job, ShardAssignment
from engine.data import load_dataset
from engine.jobinfo import JobInfo, job_info
from engine.precision import can_pre_add
from engine.sampler import shard_length, shard_samples
from engine.step import ShardResult
from engine.stored import Samples
from engine.tree import is_node
from hotstate import keys
from hotstate.blobs import BlobStore
from hotstate.bodies import drop_body, keep_body
from hotstate.gradstore import (
    audited_shards,
    covered_at_most,
    offset_in,
    pack_ref,
    pack_result,
    uploaded_shards,
)
from hotstate.recent import RECENT
from hotstate.sliceplan import read_plan
from hotstate.trainstate import read_weights, state_stored
from hotstate.version import current_version
from wire.assignment import Assignment
from wire.messages import WireError, decode_results, encode_weights
from wire.states import JobState


class StaleStep(Conflict):
    """Not the job's current step (it moved on, or the job is not running)."""


class ForeignShard(Forbidden):
    """A shard, or a job, this device holds nothing of."""


class BadUpload(Unprocessable):
    """A results message that does not decode or does not fit the job's model."""


class NotThere(NotFound):
    pass


class NotYetApplied(Conflict):
    """A slice of the next step asked for before it is applied (the phone waits and asks again)."""


class BadSlice(Unprocessable):
    """A slice index the job does not have."""


class StateMissing(Unavailable):
    """The hot state is being restored (e.g. Redis restarted empty): retry shortly."""


@dataclass(frozen=True)
class JobRow:
    id: str
    state: str
    step: int
    spec: dict[str, Any]
    step_started_at: dt.datetime | None
    state_nonce: str | None  # names the stored state of `step` (hotstate.keys.state)


class Uploaded(NamedTuple):
    accepted: list[int]  # shards of the results stored (the first of their range and step)
    duplicates: list[int]  # shards of the results dropped (their range was stored already)
    complete: bool  # every shard of the step is now covered
    partials: int  # results in the message adding several shards (engine.tree)
    shard_results: int  # results of one shard each


class ShardChunk(NamedTuple):
    body: bytes  # an .npz of x and y (and, raw, the mean and std the phone normalizes with)
    total: int  # samples in the whole shard: the agent asks again from start + len(y)


# a chunk of a shard's samples: bounded so a dataset bigger than memory never is in it; a
# few are built at once (each holds its rows, their .npz and the answer), and only small ones
# are kept: phones cache their shards, so a large chunk is rarely asked for twice
SHARD_CHUNK_BYTES = 16 << 20
SHARD_CHUNK_MAX_ROWS = 1 << 20
SHARD_BUILD_ROWS = 1 << 16  # a chunk's samples are found and read this many at a time
SHARD_CACHE_BYTES = 16 << 20
SHARD_CACHED_MAX_BYTES = 1 << 20
SHARD_BUILDS = threading.BoundedSemaphore(2)
# slices' weights messages kept (every phone asks for each): a job's current and next step
# (older ones are dropped), bounded in bytes across jobs
SLICE_CACHE_BYTES = 512 << 20


class LRU:
    """Newest first, up to `limit` in all: each value weighs `weigh(value)` (1: a count); a
    value heavier than the limit is not kept."""

    def __init__(self, limit: int, weigh: Callable[[Any], int] = lambda value: 1) -> None:
        self.limit, self.weigh, self._used = limit, weigh, 0
        self._data: OrderedDict[Any, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Any) -> Any:
        with self._lock:
            if key in self._data:
                self._data.move_to_end(key)
                return self._data[key]
        return None

    def drop(self, which: Callable[[Any], bool]) -> None:
        """Forget every key `which` says."""
        with self._lock:
            for key in [k for k in self._data if which(k)]:
                self._used -= self.weigh(self._data.pop(key))

    def put(self, key: Any, value: Any) -> None:
        weight = self.weigh(value)
        if weight > self.limit:
            return
        with self._lock:
            if key in self._data:
                self._used -= self.weigh(self._data.pop(key))
            self._data[key] = value
            self._used += weight
            while self._used > self.limit:
                _, dropped = self._data.popitem(last=False)
                self._used -= self.weigh(dropped)


@dataclass(frozen=True)
class AuditWork:
    """A node of the current step this device computes again for an audit (scheduler.audits):
    shards lo..hi-1, as `role` (`audit`, or `decide` when two results differ)."""

    lo: int
    hi: int
    role: str

    def holds(self, node: tuple[int, int]) -> bool:
        return self.lo <= node[0] and node[1] <= self.hi


AUDIT_ROLES = ("audit", "decide")


@dataclass(frozen=True)
class DeviceView:
    """What one device holds, as of one value of the version key (its `Holdings`): its shards
    per job (primary and backup), the nodes it audits at its jobs' current steps, and those
    jobs' rows."""

    held: dict[str, frozenset[int]]
    jobs: dict[str, JobRow]
    audits: dict[str, tuple[AuditWork, ...]] = field(default_factory=dict)

    def first_job(self) -> str | None:
        return next(iter(self.held), None)

    def readable(self, job_id: str) -> frozenset[int]:
        """The shards whose data and weights it may read: those it holds and those it audits."""
        audited = {k for a in self.audits.get(job_id, ()) for k in range(a.lo, a.hi)}
        return self.held.get(job_id, frozenset()) | audited


@dataclass(frozen=True)
class Holdings:
    """Every device's view as of one version value: read in one pass when the key moves, not
    once per device (every bump wakes every waiting agent, and each would re-read its own).
    Every change to assignments or to a job's state or step is committed before the version
    key is bumped (hotstate.version), so holdings read under version v stay right until the key
    moves on; the step's requests (work, weights, upload) then cost no query."""

    version: bytes
    views: dict[str, DeviceView]

    def of(self, device_id: str) -> DeviceView:
        return self.views.get(device_id) or DeviceView({}, {})


class StepProtocol:
    def __init__(self, session_factory: sessionmaker[Session], blobs: BlobStore,
                 data_dir: Path, clock: Any) -> None:
        self.session_factory, self.blobs, self.data_dir, self.clock = (
            session_factory, blobs, data_dir, clock)
        self._weights = LRU(8)
        self._slices = LRU(SLICE_CACHE_BYTES, weigh=len)
        self._locks = LRU(1024)  # one a message being made (StepProtocol._once)
        self._locks_lock = threading.Lock()
        self._shards = LRU(SHARD_CACHE_BYTES, weigh=lambda chunk: len(chunk.body))
        self._holdings: Holdings | None = None
        self._reading = threading.Lock()

    def _job(self, session: Session, job_id: str) -> JobRow | None:
        job = session.get(Job, job_id)
        if job is None:
            return None
        return JobRow(job.id, job.state, job.step, dict(job.spec or {}), job.step_started_at,
                      job.state_nonce)

    def view(self, device_id: str) -> DeviceView:
        """The device's holdings and their jobs: from the snapshot while the version key holds
        still, else from a new one (two queries, whichever device asks first)."""
        version = current_version(self.blobs)  # read BEFORE the rows: a later bump is seen
        snapshot = self._holdings
        if snapshot is None or snapshot.version != version:
            with self._reading:  # the agents woken by one bump wait for one read
                snapshot = self._holdings
                if snapshot is None or snapshot.version != version:
                    snapshot = self._holdings = self._read_holdings(version)
        return snapshot.of(device_id)

    def _read_holdings(self, version: bytes) -> Holdings:
        held: dict[str, dict[str, set[int]]] = {}
        audits: dict[str, dict[str, list[tuple[int, AuditWork]]]] = {}
        with self.session_factory() as session:  # no ORM objects: rows only
            for device, job_id, shard, role, span, since in session.execute(
                    select(ShardAssignment.device_id, ShardAssignment.job_id, ShardAssignment.shard,
                           ShardAssignment.role, ShardAssignment.span,
                           ShardAssignment.since_step)
                    .order_by(ShardAssignment.id)):
                per_job = held.setdefault(device, {}).setdefault(job_id, set())
                if role in AUDIT_ROLES:  # one row a node, for one step (`since_step`)
                    audits.setdefault(device, {}).setdefault(job_id, []).append(
                        (int(since), AuditWork(int(shard), int(shard) + int(span or 1), role)))
                else:
                    per_job.add(int(shard))
            job_ids = {j for per_device in held.values() for j in per_device}
            jobs = {row[0]: JobRow(row[0], row[1], row[2], dict(row[3] or {}), row[4], row[5])
                    for row in session.execute(
                        select(Job.id, Job.state, Job.step, Job.spec, Job.step_started_at,
                               Job.state_nonce)
                        .where(Job.id.in_(job_ids)))} if job_ids else {}
        views = {}
        for device, per_job in held.items():
            live = [j for j in per_job if j in jobs]  # a job deleted meanwhile holds nothing
            audited = {j: tuple(work for step, work in audits.get(device, {}).get(j, ())
                                if step == jobs[j].step) for j in live}
            views[device] = DeviceView({j: frozenset(per_job[j]) for j in live},
                                       {j: jobs[j] for j in live},
                                       {j: work for j, work in audited.items() if work})
        return Holdings(version, views)

    def _job_and_held(self, device_id: str, job_id: str) -> tuple[JobRow | None, frozenset[int]]:
        """The job's row and the shards this device may read of it (held or audited)."""
        view = self.view(device_id)
        job = view.jobs.get(job_id)
        if job is None:  # a job this device holds nothing of: only its existence matters
            with self.session_factory() as session:
                job = self._job(session, job_id)
        return job, view.readable(job_id)

    def info(self, job: JobRow) -> JobInfo:
        return job_info(job.id, job.spec, self.data_dir)

    # -- GET /v1/devices/{id}/work ------------------------------------------------------------
    def work(self, device_id: str) -> Assignment | None:
        """The shards of the current step this device must still upload; None: nothing now."""
        view = self.view(device_id)
        job_id = view.first_job()
        if job_id is None:
            return None
        job, held = view.jobs.get(job_id), view.held[job_id]
        if job is None or job.state != JobState.RUNNING:
            return None
        # the spec's slice count (validated at submit) names the state's keys; the job's info
        # (a lookup that serialises the spec) only for a poll that gets work
        if not state_stored(self.blobs, job.id, job.step, job.state_nonce,
                            int(job.spec.get("slices") or 1)):
            return None  # being restored; reconcile wakes us when the weights are back
        todo = sorted(held - uploaded_shards(self.blobs, job.id, job.step,
                                             int(job.spec["shards"]), over=held))
        if not todo:  # its own shards are in: a node it audits, one at a time (alone, so the
            # agent pre-adds it into that node and nothing else)
            todo = self._audit_todo(job, view.audits.get(job_id, ()))
        if not todo:
            return None
        info = self.info(job)
        slices = [list(b) for b in info.slices] if len(info.slices) > 1 else []
        return Assignment(job_id=job.id, step=job.step, shards=todo, spec=job.spec,
                          pre_reduce=can_pre_add(info.spec.upload_precision),
                          slices=slices, state=job.state_nonce, **info.assignment_facts())

    def _audit_todo(self, job: JobRow, audits: tuple[AuditWork, ...]) -> list[int]:
        """The shards of the first node this device audits that it has not uploaded yet."""
        shards = int(job.spec["shards"])
        for work in audits:
            done = audited_shards(self.blobs, job.id, job.step, shards, (work.lo, work.hi),
                                  work.role)
            todo = [k for k in range(work.lo, work.hi) if k not in done]
            if todo:
                return todo
        return []

    # -- GET /v1/jobs/{id}/weights?step=t[&slice=k] --------------------------------------------
    def weights(self, device_id: str, job_id: str, step: int,
                part: int | None = None) -> tuple[bytes | memoryview, str | None, bool]:
        """The weights message of step `step`, the name of the state it is (the nonce the
        assignment names, `X-Phalanx-State`) and whether it is served ahead of its commit.
        `part`: slice `part`'s message alone (a sliced job: engine.slices), served as soon as
        that slice of the step is applied, before the step commits (a phone fetches the next
        step's slices while the others are applied; it uses them only if the state it is
        assigned is the one they name)."""
        job, held = self._job_and_held(device_id, job_id)
        if job is None:
            raise NotThere(f"job {job_id} not found")
        if not held:
            raise ForeignShard(f"device {device_id} holds no shard of {job_id}")
        if part is not None:
            return self._slice_weights(job, step, part)
        if job.step != step:
            raise StaleStep(f"job is at step {job.step}, not {step}")
        # the state the row names: a step reached again after a rewind is another state;
        # made by this process's apply (scheduler.local_apply), else from the state
        message = self._once(self._weights, (job_id, step, job.state_nonce), lambda: (
            RECENT.weights(job_id, step, job.state_nonce) or self._encode(job, step)))
        return message, job.state_nonce, False

    def _slice_weights(self, job: JobRow, step: int, part: int) -> tuple[bytes, str, bool]:
        bounds = self.info(job).slices
        if len(bounds) == 1:
            raise BadSlice(f"job {job.id} is not sliced: ask for its weights without `slice`")
        if not 0 <= part < len(bounds):
            raise BadSlice(f"slice {part} does not exist: job {job.id} has {len(bounds)} "
                           f"slices, 0..{len(bounds) - 1}")
        if job.state != JobState.RUNNING and job.step == step - 1:
            raise StaleStep(f"job is {job.state}: step {step} will not be applied")
        nonce = job.state_nonce if job.step == step else None
        if job.step == step - 1:  # being applied: this slice may be already
            plan = read_plan(self.blobs, job.id, job.step, job.state_nonce)
            if plan is None or not self.blobs.exists(
                    keys.slice_done(job.id, job.step, plan.nonce, part)):
                raise NotYetApplied(f"slice {part} of step {step} is not applied yet")
            nonce = plan.nonce
        if nonce is None:
            raise StaleStep(f"job is at step {job.step}, not {step}")

        def make() -> bytes:
            arrays = read_weights(self.blobs, keys.state_slice(job.id, step, nonce, part),
                                  expect_step=step)
            if arrays is None:
                raise StateMissing(f"weights of step {step} are being restored; retry shortly")
            # a job's slices of older steps are asked for no more: only this step's and the
            # next are kept (a model's worth, twice, a job)
            self._slices.drop(lambda k: k[0] == job.id and k[1] < step - 1)
            return encode_weights(job.id, step, *arrays, part=bounds[part])

        message = self._once(self._slices, (job.id, step, nonce, part), make)
        return message, nonce, job.step == step - 1

    def _once(self, cache: LRU, key: tuple[Any, ...], make: Callable[[], Any]) -> Any:
        """`cache[key]`, made once: every phone asks for a step's weights at once, and each
        message is read and encoded once per process (a lock per key: other messages are
        made side by side)."""
        found = cache.get(key)
        if found is not None:
            return found
        with self._locks_lock:
            lock = self._locks.get(key)
            if lock is None:
                lock = threading.Lock()
                self._locks.put(key, lock)
        with lock:
            found = cache.get(key)
            if found is None:
                found = make()
                cache.put(key, found)
            return found

    def _encode(self, job: JobRow, step: int) -> bytes:
        """The weights message from the state in the blob store: when another process applied
        the step, or the state was restored from a checkpoint; a sliced job's from its slices
        (the buffers travel in the first). Only params and buffers are read (two thirds of the
        state's bytes), once per step and process."""
        slices = len(self.info(job).slices)
        parts = [read_weights(self.blobs, key, expect_step=step)
                 for key in keys.state_keys(job.id, step, job.state_nonce, slices)]
        if any(p is None for p in parts):
            raise StateMissing(f"weights of step {step} are being restored; retry shortly")
        got = [p for p in parts if p is not None]
        params = got[0][0] if slices == 1 else np.concatenate([p for p, _ in got])
        return encode_weights(job.id, step, params, got[0][1])

    # -- GET /v1/jobs/{id}/shards/{k}/data ----------------------------------------------------
    def shard_data(self, device_id: str, job_id: str, shard: int, start: int | None = None,
                   raw: bool = False) -> ShardChunk:
        """The shard's samples from `start` on, as many as SHARD_CHUNK_BYTES holds; without
        `start` (agents before chunks), all of them when they fit one chunk (else 422: ask in
        chunks). `raw`: as stored, with the mean and std
        the phone normalizes them with (engine.stored.normalize; a quarter of the bytes for
        uint8 images); else float32 normalized here."""
        job, held = self._job_and_held(device_id, job_id)
        if job is None:
            raise NotThere(f"job {job_id} not found")
        if shard not in held:
            raise ForeignShard(f"shard {shard} of {job_id} is not assigned to {device_id}")
        key = (job_id, shard, start, raw)
        cached = self._shards.get(key)
        if cached is not None:
            return cached
        info = self.info(job)
        with SHARD_BUILDS:
            chunk = _shard_chunk(info.spec.dataset, str(self.data_dir), info.n_train,
                                 info.spec.shards, info.spec.seed, shard, start, raw)
        if len(chunk.body) <= SHARD_CACHED_MAX_BYTES:
            self._shards.put(key, chunk)
        return chunk

    # -- POST /v1/jobs/{id}/steps/{t}/diverged -----------------------------------------------
    def diverged(self, device_id: str, job_id: str, step: int, shard: int, reason: str,
                 kind: str = "diverged") -> bool:
        """Fail the job: a shard this device holds has no finite result at the current step.
        Every device computes a shard's result bit for bit alike (invariant 1), so another
        device would find the same; the job stops with the reason instead of retrying for ever."""
        job, held = self._job_and_held(device_id, job_id)
        if job is None:
            raise NotThere(f"job {job_id} not found")
        if shard not in held:
            raise ForeignShard(f"shard {shard} of {job_id} is not assigned to {device_id}")
        if job.step != step or job.state != JobState.RUNNING:
            raise StaleStep(f"job is at step {job.step} ({job.state}), not {step}")
        if kind == "compute_error":
            why = (f"cannot compute step {step}: {reason} (device {device_id}); every phone "
                   f"would meet it: check the model's size against the phones' memory (a dry "
                   f"run's plan) and the spec")
        else:
            why = (f"diverged at step {step}: {reason} (device {device_id}); lower the learning "
                   f"rate, add warmup, or upload in float32/bfloat16")
        with self.session_factory.begin() as session:
            return fail_diverged(session, job_id, step, why, self.clock())

    # -- POST /v1/jobs/{id}/steps/{t}/gradients -----------------------------------------------
    def upload(self, device_id: str, job_id: str, step: int, body: bytes) -> Uploaded:
        """Store each shard's result (or partial) once: the first upload wins."""
        job, held = self._job_and_held(device_id, job_id)
        if job is None:
            raise NotThere(f"job {job_id} not found")
        if not held:  # before any fact of the job: a stranger learns nothing of its step
            raise ForeignShard(f"{device_id} holds no shard of {job_id}")
        if job.step != step or job.state != JobState.RUNNING:
            raise StaleStep(f"job is at step {job.step} ({job.state}), not {step}: result dropped")
        info = self.info(job)
        try:
            results = decode_results(body, expect_job=job_id, expect_step=step,
                                     n_params=info.model.n_params, n_stats=info.model.n_stats,
                                     expect_dtype=info.spec.upload_precision)
        except WireError as exc:
            raise BadUpload(str(exc)) from None
        for r in results:  # a partial must be a node of the job's tree, of the right size
            if r.span > 1 and not can_pre_add(info.spec.upload_precision):
                raise BadUpload(f"shards {r.shard}..{r.shard + r.span - 1}: a job uploading in "
                                f"{info.spec.upload_precision} takes each shard's result, not "
                                f"partials (their sums leave its range)")
            if not is_node(*r.node, info.spec.shards):
                raise BadUpload(f"shards {r.shard}..{r.shard + r.span - 1} are not a node of the "
                                f"reduction tree over {info.spec.shards} shards")
            if r.count != r.span * info.spec.per_shard_batch:
                raise BadUpload(f"shard {r.shard}: {r.count} samples, expected "
                                f"{r.span * info.spec.per_shard_batch}")
        audits = self.view(device_id).audits.get(job_id, ())
        own = self.view(device_id).held.get(job_id, frozenset())
        roles = [next((a.role for a in audits if a.holds(r.node)), None) for r in results]
        foreign = sorted({k for r, role in zip(results, roles) if role is None
                          for k in range(*r.node)} - own)
        if foreign:
            raise ForeignShard(f"shards {foreign} of {job_id} are not assigned to {device_id}")
        if any(roles):  # a node computed again for an audit: kept apart, never applied
            return self._audited(device_id, job, info.spec.shards, body, results, roles)
        accepted, duplicates, counted = store_results(self.blobs, job_id, step, body, results,
                                                      device_id)
        if job.step_started_at is not None and accepted:
            took = (self.clock() - job.step_started_at).total_seconds()
            self.blobs.set(keys.latency(job_id, device_id), f"{took:.4f}".encode(), ttl=3600)
        # asked only when the count says the step may be complete, or when a result was stored
        # already (a retry, a backup's: an earlier attempt may have stored and not counted, or
        # not got as far as sending the step's apply)
        shards = info.spec.shards
        complete = (counted >= shards or bool(duplicates)) and \
            len(uploaded_shards(self.blobs, job_id, step, shards)) >= shards
        return Uploaded(accepted, duplicates, complete,
                        partials=sum(r.span > 1 for r in results),
                        shard_results=sum(r.span == 1 for r in results))

    def _audited(self, device_id: str, job: JobRow, shards: int, body: bytes,
                 results: list[ShardResult], roles: list[str | None]) -> Uploaded:
        """An auditor's (or decider's) upload: each result under its own key (first wins).
        Complete when the step's own results are all in too: the step's apply, which waited
        for the audit, is sent again."""
        if not all(roles):
            raise BadUpload("an upload is either a node audited or the device's own shards, "
                            "not both in one message")
        accepted, duplicates = store_audit_results(
            self.blobs, job.id, job.step, body, list(zip(results, [str(r) for r in roles])),
            device_id)
        complete = len(uploaded_shards(self.blobs, job.id, job.step, shards)) >= shards
        return Uploaded(accepted, duplicates, complete and bool(accepted),
                        partials=sum(r.span > 1 for r in results),
                        shard_results=sum(r.span == 1 for r in results))


def store_results(blobs: BlobStore, job_id: str, step: int, body: bytes | memoryview,
                  results: list[ShardResult], device_id: str | None = None
                  ) -> tuple[list[int], list[int], int]:
    """Each shard's result (or partial) under its key, first upload wins; returns the shards
    of the results that won, of those that lost, and the step's count of stored shards after
    counting the winners (gradstore.covered_at_most; 0 when none won). The body is kept once
    as it came (before any reference to it), and each result's key points into it; a body that
    won nothing is dropped again. `device_id`: the uploader, kept beside each result that won
    (keys.uploader: whom an audit of it judges)."""
    accepted: list[int] = []
    counted = 0
    try:
        won, duplicates = _store_once(
            blobs, job_id, step, body, [(r, keys.grad(job_id, step, r.shard, r.span),
                                         keys.uploader(job_id, step, r.shard, r.span))
                                        for r in results], device_id, accepted)
    finally:  # what was stored is counted even when a later write fails
        counted = covered_at_most(blobs, job_id, step, len(accepted)) if accepted else 0
    return won, duplicates, counted


def store_audit_results(blobs: BlobStore, job_id: str, step: int, body: bytes | memoryview,
                        results: list[tuple[ShardResult, str]], device_id: str
                        ) -> tuple[list[int], list[int]]:
    """An auditor's results, each under its audit key for its role (keys.audit), first wins;
    never counted as the step's: they are compared, not applied."""
    return _store_once(blobs, job_id, step, body, [
        (r, keys.audit(job_id, step, r.shard, r.span, role),
         keys.uploader(job_id, step, r.shard, r.span, role)) for r, role in results],
        device_id, [])


def _store_once(blobs: BlobStore, job_id: str, step: int, body: bytes | memoryview,
                named: list[tuple[ShardResult, str, str]], device_id: str | None,
                accepted: list[int]) -> tuple[list[int], list[int]]:
    """Each result under its key (set if absent) and, when it won, its uploader under the
    other; `accepted` grows as they win (the caller counts them even when a write fails)."""
    offsets = [(offset_in(r.grad_sum, body), offset_in(r.stats, body)) for r, _, _ in named]
    by_ref = any(g is not None and s is not None for g, s in offsets)
    body_key = ""
    if by_ref:  # on this replica's shelf in production (hotstate.bodies), else in the store
        body_key = keep_body(blobs, job_id, step, body,
                             keys.upload_body(job_id, step, uuid.uuid4().hex))
    duplicates: list[int] = []
    referenced = False
    for (r, key, by), (g_off, s_off) in sorted(zip(named, offsets), key=lambda x: x[0][0].shard):
        ref = g_off is not None and s_off is not None
        blob = pack_ref(r, body_key, g_off, s_off) if ref else pack_result(r)
        if blobs.set_if_absent(key, blob):
            if device_id is not None:
                blobs.set(by, device_id.encode())
            accepted.extend(range(*r.node))
            referenced = referenced or ref
        else:
            duplicates.extend(range(*r.node))
    if by_ref and not referenced:
        drop_body(blobs, body_key)
    return accepted, duplicates


def chunk_rows(sample: tuple[int, ...]) -> int:
    """Samples in one chunk of a shard: SHARD_CHUNK_BYTES of them as float32 (Python integers:
    a sample's size comes from an upload), at least one and at most SHARD_CHUNK_MAX_ROWS (their
    int64 labels: 8 bytes a sample more)."""
    per_sample = 4 * math.prod(int(d) for d in sample)
    return max(1, min(SHARD_CHUNK_MAX_ROWS, SHARD_CHUNK_BYTES // per_sample))


def _shard_chunk(dataset: str, data_dir: str, n_train: int, shards: int, seed: int,
                 shard: int, start: int | None, raw: bool) -> ShardChunk:
    """Samples [start, start + chunk_rows) of the shard, in the sampler's order: their indices
    computed for them alone (engine.sampler.shard_samples) and read SHARD_BUILD_ROWS at a
    time, so a chunk costs its own bytes, never the dataset's or the shard's. Without `start`
    (agents before chunks, the simulator) the whole shard, when it fits one chunk."""
    data = load_dataset(dataset, data_dir)
    total, x_train = shard_length(n_train, shards, shard), data.x_train
    sample = tuple(x_train.shape[1:])
    rows = chunk_rows(sample)
    if start is None:
        if total > rows:
            raise Invalid("start", f"shard {shard} holds {total:,} samples, more than one "
                          f"answer carries ({rows:,}): ask for it in chunks from start=0",
                          where="query")
        start = 0
    count = max(0, min(rows, total - start))
    stored = isinstance(x_train, Samples)
    as_stored = raw and stored
    x_dtype = x_train.stored.dtype if as_stored else np.float32
    x_shape = (*x_train.stored.row_shape,) if as_stored else sample
    x = np.empty((count, *x_shape), x_dtype)
    y = np.empty(count, np.int64)
    for at in range(0, count, SHARD_BUILD_ROWS):
        end = min(at + SHARD_BUILD_ROWS, count)
        idx = shard_samples(n_train, shards, seed, shard, start + at, start + end)
        x[at:end] = x_train.raw(idx) if as_stored else x_train[idx]
        y[at:end] = data.y_train[idx]
    arrays = {"y": y, "x": x}
    if as_stored and x_train.mean is not None and x_train.std is not None:
        arrays.update(mean=x_train.mean, std=x_train.std)
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    del x, y, arrays
    return ShardChunk(buf.getvalue(), total)
