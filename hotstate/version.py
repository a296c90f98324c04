"""Waking long polls: one small version key, bumped after any step or assignment change.

Waiting agents never poll the database: each API process runs one watcher of this key that
wakes its waiters when the value changes; they then re-read their assignment once. A bump
made in the watcher's own process (embedded mode: apply_step runs in the server) pokes the
watcher at once. A bump in another process (a worker, another replica) is published on the
store's channel for the key (Redis pub/sub), and each watcher's listening thread pokes it:
the watcher reads the key once per bump instead of every few milliseconds (at 8 agents that
was ~27 GETs a step from one replica, on its event loop). While the subscription is down
(Redis restarting), or to catch a notice lost meanwhile, the watcher also reads the key every
`interval_s` (then SAFETY_POLL_S while listening).

At shutdown the server stops every watcher of its process (`stop_waits`): each wait returns at
once and every later one too, so a long poll answers as at its timeout instead of holding the
server until its graceful timeout.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
import weakref

from hotstate import keys
from hotstate.blobs import BlobStore, MemoryBlobStore

log = logging.getLogger(__name__)
_WATCHERS: weakref.WeakSet[VersionWatch] = weakref.WeakSet()


def bump_version(blobs: BlobStore, key: str = keys.VERSION) -> None:
    """`key`: keys.VERSION (work polls), or keys.SLICES_VERSION (phones waiting for a slice of
    the next step: a slice applied wakes them, not every work poll)."""
    blobs.set(key, f"{time.time_ns()}-{uuid.uuid4().hex[:8]}".encode())
    try:
        blobs.publish(key)
    except Exception:  # noqa: BLE001 - the bump is stored: watchers see it at their next read
        log.warning("could not publish a bump of %s; watchers will read it by polling", key)
    for watcher in list(_WATCHERS):
        if watcher.key == key:
            watcher.poke()


def current_version(blobs: BlobStore, key: str = keys.VERSION) -> bytes:
    return blobs.get(key) or b""


def stop_waits() -> None:
    """The server is stopping: every watcher of this process answers its waiters now, and
    every later wait at once (from any thread)."""
    for watcher in list(_WATCHERS):
        watcher.stop()


# How often a watcher reads a shared store's key while its subscription is live: only a notice
# lost (Redis restarting between a bump and the subscription) waits this long
SAFETY_POLL_S = 0.25
# Pause before listening again after the subscription dropped (Redis down or restarting)
RESUBSCRIBE_S = 1.0

# How often a watcher reads an in-process store's key: every bump there pokes the watcher
# (embedded mode runs apply_step and reconcile in the server), so the read is only a safety
# net, and 200 wakeups a second of the event loop would compete for the GIL with the uploads.
LOCAL_POLL_S = 0.25


class VersionWatch:
    """An asyncio watcher of the version key for one API process (one event loop)."""

    @classmethod
    def for_store(cls, blobs: BlobStore, interval_s: float, key: str = keys.VERSION) -> VersionWatch:
        """Polling every `interval_s` for a shared store (Redis: bumps come from workers in
        other processes); rarely for a store of this process, whose bumps all poke."""
        local = isinstance(blobs, MemoryBlobStore)
        return cls(blobs, max(interval_s, LOCAL_POLL_S) if local else interval_s, key)

    def __init__(self, blobs: BlobStore, interval_s: float = 0.005,
                 key: str = keys.VERSION) -> None:
        self.blobs, self.interval_s, self.key = blobs, interval_s, key
        self._waiters = 0
        self._changed: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._seen = b""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listening = False  # a live subscription to the key's notices
        self._listener: threading.Thread | None = None
        # whether other processes publish bumps of the key (Redis): asked once, not per poll
        self._has_notices = blobs.notices(key) is not None
        self._stopping = False
        _WATCHERS.add(self)

    @property
    def stopping(self) -> bool:
        """Whether the server is stopping: a long poll answers as at its timeout."""
        return self._stopping

    def stop(self) -> None:
        """Wake every waiter now and make later waits return at once (from any thread)."""
        self._stopping = True
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._wake)
        except RuntimeError:  # the loop closed meanwhile
            pass

    def _wake(self) -> None:
        old, self._changed = self._changed, asyncio.Event()
        if old is not None:
            old.set()

    def poke(self) -> None:
        """Re-read the key now (from any thread): a bump in this process, or a notice of one
        elsewhere, needs no poll. Not only while someone waits: a waiter between its snapshot
        and its wait must still see the change."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(self._check)
        except RuntimeError:  # the loop closed meanwhile
            pass

    def snapshot(self) -> bytes:
        """The version as this watcher last saw it: take it BEFORE reading the assignment, so
        a change committed after the read is never missed."""
        self._ensure_running()
        return self._seen

    async def wait_change(self, since: bytes, timeout: float) -> bytes:
        """Return the version once it differs from `since`, or after `timeout` seconds, or at
        once while stopping."""
        self._ensure_running()
        deadline = time.monotonic() + timeout
        self._waiters += 1
        try:
            while self._seen == since and not self._stopping:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                assert self._changed is not None
                event = self._changed
                try:
                    await asyncio.wait_for(event.wait(), remaining)
                except asyncio.TimeoutError:
                    break
            return self._seen
        finally:
            self._waiters -= 1

    def _ensure_running(self) -> None:
        if self._task is None or self._task.done():
            self._seen = current_version(self.blobs, self.key)
            self._changed = asyncio.Event()
            self._loop = asyncio.get_running_loop()
            self._task = self._loop.create_task(self._run())
        listener = self._listener
        if self._has_notices and (listener is None or not listener.is_alive()):
            self._listener = threading.Thread(target=self._listen, daemon=True,
                                              name=f"notices-{self.key}")
            self._listener.start()

    def _listen(self) -> None:
        """Poke the watcher at every notice of a bump, until its event loop is closed (the
        server stopped: a test's app, or a reload)."""
        while not self._loop_closed():
            try:
                for _ in self.blobs.notices(self.key) or ():
                    self._listening = True  # subscribed: the first item, then one a notice
                    if self._loop_closed():
                        break  # leaving the loop closes the subscription
                    self.poke()
            except Exception:  # noqa: BLE001 - Redis down: poll meanwhile, then listen again
                pass
            self._listening = False
            if not self._loop_closed():
                time.sleep(RESUBSCRIBE_S)
        self._listening = False

    def _loop_closed(self) -> bool:
        loop = self._loop
        return loop is not None and loop.is_closed()

    async def _run(self) -> None:
        idle_since = time.monotonic()
        while True:
            await asyncio.sleep(SAFETY_POLL_S if self._listening else self.interval_s)
            if self._waiters == 0:
                if time.monotonic() - idle_since > 5.0:
                    return  # nobody waits: stop reading the key until someone does
                continue
            idle_since = time.monotonic()
            if not self._check():
                await asyncio.sleep(0.5)  # a Redis hiccup must not kill the watcher

    def _check(self) -> bool:
        """Wake the waiters if the key moved; False when it could not be read."""
        try:
            value = current_version(self.blobs, self.key)
        except Exception:  # noqa: BLE001
            return False
        if value != self._seen:
            self._seen = value
            self._wake()
        return True
