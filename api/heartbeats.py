"""The group-commit heartbeat writer for SQLite (embedded mode): one transaction for every
heartbeat pending right now. Postgres has its own on the event loop (api.heartbeat_writer_pg).

Request handlers (async) hand their validated heartbeat to `HeartbeatWriter.submit` and await
the reply. One writer thread per process takes everything queued, applies it in a single
transaction (`domain.store.heartbeats.apply_heartbeats`) and only then resolves the waiting
requests: a 2xx means the lease and the samples are committed (invariant 2). Under load the
batches grow by themselves, since requests queue up while the previous commit runs.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from sqlalchemy import Engine
from sqlalchemy.orm import Session, sessionmaker

from api.schemas.devices import HeartbeatIn
from domain.store.heartbeats import BatchOutcome, active_archs_query, apply_heartbeats

log = logging.getLogger(__name__)
MAX_BATCH = 2000
ACTIVE_ARCHS_TTL_S = 2.0

_Pending = tuple[str, str, HeartbeatIn, asyncio.AbstractEventLoop, "asyncio.Future[Any]"]


class HeartbeatWriter:
    def __init__(self, engine: Engine, *, clock: Callable, grace_s: float,
                 interval_s: float, on_device_changed: Callable[[str], None],
                 threads: int = 1, token_max_age_s: float = float("inf")) -> None:
        self.engine, self.clock = engine, clock
        self.factory = sessionmaker(bind=engine, expire_on_commit=False)
        self.threads = threads
        self.grace_s, self.interval_s = grace_s, interval_s
        self.token_max_age_s = token_max_age_s
        self.on_device_changed = on_device_changed
        self._queue: queue.SimpleQueue[_Pending | None] = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        self._start_lock = threading.Lock()
        self._archs: tuple[float, set[str]] = (0.0, set())
        self.batches = 0  # for tests and the benchmark: how many transactions ran

    async def submit(self, device_id: str, token_hash: str, body: HeartbeatIn) -> dict[str, Any]:
        """Queue one heartbeat and wait for its commit. Raises the refusal (401/403) for a bad
        token, or UnknownToken when the hash matches no device token."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._ensure_started()
        self._queue.put((device_id, token_hash, body, loop, future))
        return await future

    def _ensure_started(self) -> None:
        if not self._workers:
            with self._start_lock:
                if not self._workers:
                    self._workers = [
                        threading.Thread(target=self._run, name=f"heartbeat-writer-{i}",
                                         daemon=True) for i in range(self.threads)]
                    for worker in self._workers:
                        worker.start()

    async def aclose(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.stop)
        self.engine.dispose()

    def stop(self, timeout: float = 10.0) -> None:
        """Finish everything queued, then end the threads."""
        workers, self._workers = self._workers, []
        for _ in workers:
            self._queue.put(None)
        for worker in workers:
            worker.join(timeout)

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:  # stop signals come after everything queued before stop()
                return
            batch: list[_Pending] = [first]
            stopping = False
            while len(batch) < MAX_BATCH:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:  # one stop signal per thread: take no other thread's
                    stopping = True
                    break
                batch.append(item)
            self._process(batch)
            if stopping:
                return

    def _process(self, batch: list[_Pending]) -> None:
        items = [(device_id, token_hash, body) for device_id, token_hash, body, _, _ in batch]
        try:
            outcome = self._commit(items)
            replies: list[Any] = outcome.replies
        except Exception:
            # One bad heartbeat must not fail its neighbours: retry each on its own.
            log.exception("heartbeat batch of %d failed; retrying one by one", len(items))
            replies, changed = [], []
            for item in items:
                try:
                    single = self._commit([item])
                    replies.extend(single.replies)
                    changed.extend(single.changed_devices)
                except Exception as exc:
                    replies.append(exc)
            outcome = BatchOutcome(replies=replies, changed_devices=changed)
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Any, Any]]] = {}
        for (_, _, _, loop, future), reply in zip(batch, replies):
            by_loop.setdefault(loop, []).append((future, reply))
        for loop, pairs in by_loop.items():  # one wake-up per event loop, not per heartbeat
            loop.call_soon_threadsafe(_resolve_all, pairs)
        for device_id in outcome.changed_devices:
            try:
                self.on_device_changed(device_id)
            except Exception:
                log.exception("device_changed hook failed for %s", device_id)

    def _commit(self, items: list[tuple[str, str, HeartbeatIn]]) -> BatchOutcome:
        now = self.clock()
        with self.factory() as session, session.begin():
            outcome = apply_heartbeats(session, items, now, grace_s=self.grace_s,
                                       interval_s=self.interval_s,
                                       active_archs=self._active_archs(session),
                                       token_max_age_s=self.token_max_age_s)
        self.batches += 1
        return outcome

    def _active_archs(self, session: Session) -> set[str]:
        """Archs of Pending/Running jobs (devices lacking a profile for one are asked for it)."""
        fetched_at, archs = self._archs
        if time.monotonic() - fetched_at < ACTIVE_ARCHS_TTL_S:
            return archs
        archs = {arch for arch in session.scalars(active_archs_query()) if arch}
        self._archs = (time.monotonic(), archs)
        return archs


def _resolve_all(pairs: list[tuple[asyncio.Future[Any], Any]]) -> None:
    for future, reply in pairs:
        resolve(future, reply)


def resolve(future: asyncio.Future[Any], reply: Any) -> None:
    """Answer one waiting request with its reply or its refusal."""
    if future.done():  # the client went away
        return
    if isinstance(reply, BaseException):
        future.set_exception(reply)
    else:
        future.set_result(reply)
