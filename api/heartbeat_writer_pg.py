"""The Postgres group commit, on the event loop itself.

Same contract as `api.heartbeats.HeartbeatWriter` (a 2xx only after the commit; one statement
per batch; one bad heartbeat never fails its neighbours) but without writer threads: each
batch is sent on an asyncio psycopg connection, and the reply wakes the loop like any socket.
With threads, every database round trip had to win the GIL back from a busy event loop, and
a batch spent most of its wall time waiting for that, not for Postgres (measured: ~5.6 ms per
batch, 1.4 ms of it on a CPU; docs/benchmarks.md). One connection per process by default:
while a batch is in Postgres the next one gathers, and a batch takes all that waited (two or
four connections pipelined more but made smaller batches, and measured slower: each batch
costs Postgres a round trip, a plan and a commit).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import psycopg
from psycopg.rows import namedtuple_row
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from api.heartbeats import resolve
from api.schemas.devices import HeartbeatIn
from domain.store import heartbeats_pg
from domain.store.db import libpq_url
from domain.store.heartbeats import BatchOutcome, batch_outcome, read_batch
from domain.store.heartbeats_pg import ACTIVE_ARCHS

log = logging.getLogger(__name__)
MAX_BATCH = 2000
ACTIVE_ARCHS_TTL_S = 2.0
# json_to_recordset() is estimated at 100 rows whatever the batch holds, which makes the planner
# hash-join whole tables (a seq scan of every device and token per batch: 2.1 ms -> 0.9 ms per
# batch of 8 at 1,000 devices, worse as the fleet grows). These connections run only the
# batch statement and two small indexed reads, so index plans are always right for them.
PLANNER_OPTIONS = "-c enable_seqscan=off -c enable_hashjoin=off -c enable_mergejoin=off"

_Pending = tuple[str, str, HeartbeatIn, "asyncio.Future[Any]"]


class AsyncPgHeartbeatWriter:
    def __init__(self, database_url: str, engine: Engine, *, clock: Callable, grace_s: float,
                 interval_s: float, on_device_changed: Callable[[str], None],
                 connections: int = 1, token_max_age_s: float = float("inf")) -> None:
        self.conninfo = libpq_url(database_url)
        self.engine = engine  # the app's: only for the rare refused heartbeat
        self.clock, self.grace_s, self.interval_s = clock, grace_s, interval_s
        self.token_max_age_s = token_max_age_s
        self.on_device_changed = on_device_changed
        self.connections = connections
        # for tests and the benchmark: statements run, heartbeats they carried
        self.batches = self.heartbeats = 0
        self._archs: tuple[float, set[str]] = (0.0, set())
        self._reset(None)

    def _reset(self, loop: asyncio.AbstractEventLoop | None) -> None:
        """Bind to a loop. Connections belong to the loop they were opened on; a server has one
        loop per process, but TestClient may start a fresh one per request."""
        for conn in getattr(self, "_idle", []):
            conn.pgconn.finish()
        self._loop = loop
        self._pending: list[_Pending] = []
        self._idle: list[psycopg.AsyncConnection] = []
        self._running = 0
        self._tasks: set[asyncio.Task] = set()

    async def submit(self, device_id: str, token_hash: str, body: HeartbeatIn) -> dict[str, Any]:
        """Queue one heartbeat and wait for its commit. Raises the refusal (401/403) for a bad
        token, or UnknownToken when the hash matches no device token."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._reset(loop)
        future: asyncio.Future[Any] = loop.create_future()
        self._pending.append((device_id, token_hash, body, future))
        if self._running < self.connections:
            self._running += 1
            task = loop.create_task(self._drain())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        return await future

    async def _drain(self) -> None:
        """Run batches until nothing waits; the batch is taken when the task runs, so every
        heartbeat that arrived meanwhile rides along."""
        loop = self._loop
        try:
            while self._pending and self._loop is loop:
                await asyncio.sleep(0)  # one more loop turn: requests already read join in
                batch, self._pending = self._pending[:MAX_BATCH], self._pending[MAX_BATCH:]
                await self._process(batch)
        finally:
            if self._loop is loop:  # after a _reset the count belongs to the new loop
                self._running -= 1

    async def _process(self, batch: list[_Pending]) -> None:
        items = [(device_id, token_hash, body) for device_id, token_hash, body, _ in batch]
        try:
            outcome = await self._commit(items)
        except Exception:
            # One bad heartbeat must not fail its neighbours: retry each on its own.
            if len(items) > 1:
                log.exception("heartbeat batch of %d failed; retrying one by one", len(items))
            replies: list[Any] = []
            changed: list[str] = []
            for item in items:
                try:
                    single = await self._commit([item])
                    replies.extend(single.replies)
                    changed.extend(single.changed_devices)
                except Exception as exc:
                    replies.append(exc)
            outcome = BatchOutcome(replies=replies, changed_devices=changed)
        for (_, _, _, future), reply in zip(batch, outcome.replies):
            resolve(future, reply)
        if outcome.changed_devices:  # the hook talks to the broker: not on the loop
            asyncio.get_running_loop().run_in_executor(
                None, self._notify, list(outcome.changed_devices))

    def _notify(self, device_ids: list[str]) -> None:
        for device_id in device_ids:
            try:
                self.on_device_changed(device_id)
            except Exception:
                log.exception("device_changed hook failed for %s", device_id)

    async def _commit(self, items: list[tuple[str, str, HeartbeatIn]]) -> BatchOutcome:
        now = self.clock()
        conn = self._idle.pop() if self._idle else await psycopg.AsyncConnection.connect(
            self.conninfo, autocommit=True, options=PLANNER_OPTIONS, row_factory=namedtuple_row)
        try:
            archs = await self._active_archs(conn)
            renewed = await heartbeats_pg.apply_batch_async(conn, items, now)
        except BaseException:
            await conn.close()  # its state is unknown: never reuse it
            raise
        self._idle.append(conn)
        self.batches += 1
        self.heartbeats += len(items)
        refused = [item for item in items if (item[0], item[1]) not in renewed]
        why = await asyncio.get_running_loop().run_in_executor(
            None, self._read_refused, refused) if refused else {}
        return batch_outcome(items, renewed, why, now, grace_s=self.grace_s,
                             interval_s=self.interval_s, active_archs=archs,
                             token_max_age_s=self.token_max_age_s)

    def _read_refused(self, refused: list[tuple[str, str, HeartbeatIn]]) -> dict[str, Any]:
        with Session(self.engine) as session:
            return read_batch(session, refused, self.clock())

    async def _active_archs(self, conn: psycopg.AsyncConnection) -> set[str]:
        """Archs of Pending/Running jobs (devices lacking a profile for one are asked for it)."""
        fetched_at, archs = self._archs
        if time.monotonic() - fetched_at < ACTIVE_ARCHS_TTL_S:
            return archs
        rows = await (await conn.execute(ACTIVE_ARCHS)).fetchall()
        archs = {row.arch for row in rows if row.arch}
        self._archs = (time.monotonic(), archs)
        return archs

    async def aclose(self) -> None:
        """Finish the batches in flight, then close the connections."""
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        same_loop = self._loop is asyncio.get_running_loop()
        for conn in self._idle:
            if same_loop:
                await conn.close()
            else:
                conn.pgconn.finish()
        self._idle = []
