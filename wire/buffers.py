"""Model-sized byte buffers, handed out again once nothing references them.

Every step a server receives an upload per phone and makes a state and a weights message, each a
buffer of the same few sizes (12.9 MB a mobilenet_v1 vector, 94 MB a resnet50 one). Allocated
fresh each time, the kernel hands out and zeroes new pages for each one (glibc's malloc maps
blocks above 32 MiB afresh whatever its tunables, and gives smaller ones back now and then:
engine.memory): page faults and clear_page on the step's critical path. A pool keeps the buffers
it made and hands one out again when the only reference left to it is the pool's own: a view of
it, an array made from it or a memoryview held anywhere keeps it out of reach, so a buffer is never
reused while anything can still read or write it. Sizes are rounded up to a 64 KiB class (an
upload's size moves with its header's digits). The pool holds at most `max_bytes`, and lets go of
a buffer nothing has used for `idle_s` seconds (checked by a thread every idle_s / 2 while the
pool holds any, not on each request: a finished job's buffers are not kept for good).
"""

from __future__ import annotations

import sys
import sysconfig
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

POOLED_MIN_BYTES = 1 << 20  # below this malloc's own free lists do the job
SIZE_CLASS = 1 << 16
IDLE_S = 60.0


def _counts_references() -> bool:
    """Whether sys.getrefcount tells when nothing but the pool holds an array: CPython with its
    GIL (PyPy has no such count; a free-threaded build splits it), checked on a live array."""
    if sys.implementation.name != "cpython" or sysconfig.get_config_var("Py_GIL_DISABLED"):
        return False
    probe = np.empty(8, np.uint8)
    alone = sys.getrefcount(probe)
    view = memoryview(probe)[2:4]
    held = sys.getrefcount(probe)
    del view
    return alone == 2 and held == 3 and sys.getrefcount(probe) == 2


POOLING = _counts_references()


@dataclass(slots=True)
class _Pooled:
    array: np.ndarray
    last_used: float


def _fresh(size: int) -> memoryview:
    # numpy's allocator, not bytearray (which zero-fills through calloc): 5.2-6.5 ms against
    # 1.1-1.7 ms for 12.9 MB buffers alive eight at a time (docs/benchmarks.md)
    return memoryview(np.empty(size, np.uint8)).cast("B")


def _free(pooled: _Pooled) -> bool:
    # two references: the pool's and getrefcount's argument; anything else that can reach the
    # bytes (a memoryview, a slice of one, an array on them) holds a third
    return sys.getrefcount(pooled.array) == 2


class BufferPool:
    def __init__(self, max_bytes: int, idle_s: float = IDLE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_bytes, self.idle_s, self._clock = max_bytes, idle_s, clock
        self._lock = threading.Lock()
        self._by_class: dict[int, list[_Pooled]] = {}
        self.held_bytes = 0
        self.reused = 0  # buffers handed out again (a page fault and a zeroing saved per page)
        self._sweeper: threading.Thread | None = None
        # told (held_bytes, whether a buffer was handed out again) after each request and
        # sweep, under the pool's lock: the server's metrics (api.metrics.watch_buffer_pool)
        self.watch: Callable[[int, bool], None] | None = None

    def take(self, size: int) -> memoryview:
        """`size` writable bytes, not zeroed (any earlier content may be there)."""
        if size < POOLED_MIN_BYTES or self.max_bytes <= 0 or not POOLING:
            return _fresh(size)
        cls = -(-size // SIZE_CLASS) * SIZE_CLASS
        with self._lock:
            view, reused = self._take(size, cls, self._clock())
            if self.watch is not None:
                self.watch(self.held_bytes, reused)
            return view

    def _take(self, size: int, cls: int, now: float) -> tuple[memoryview, bool]:
        for pooled in self._by_class.get(cls, ()):
            if _free(pooled):
                pooled.last_used = now
                self.reused += 1
                return memoryview(pooled.array).cast("B")[:size], True
        if self.held_bytes + cls > self.max_bytes:
            return _fresh(size), False
        array = np.empty(cls, np.uint8)
        self._by_class.setdefault(cls, []).append(_Pooled(array, now))
        self.held_bytes += cls
        if self._sweeper is None:
            self._sweeper = threading.Thread(target=self._sweep, name="buffer-pool", daemon=True)
            self._sweeper.start()
        return memoryview(array).cast("B")[:size], False

    def _sweep(self) -> None:
        """Every idle_s / 2, off the requests' path; ends once the pool is empty (the next
        buffer it makes starts another)."""
        while True:
            time.sleep(self.idle_s / 2)
            self.let_go_idle()
            with self._lock:
                if not self._by_class:
                    self._sweeper = None
                    return

    def let_go_idle(self) -> None:
        """Buffers nothing has held for idle_s leave the pool (freed once nothing else holds
        them); one still in use (a state kept for a long step, a body on the shelf) counts as
        used now."""
        now = self._clock()
        with self._lock:
            for cls, pooled in list(self._by_class.items()):
                for p in pooled:
                    if not _free(p):
                        p.last_used = now
                kept = [p for p in pooled if now - p.last_used < self.idle_s]
                self.held_bytes -= cls * (len(pooled) - len(kept))
                if kept:
                    self._by_class[cls] = kept
                else:
                    del self._by_class[cls]
            if self.watch is not None:
                self.watch(self.held_bytes, False)


# the process's pool: a server and a worker size it from their settings (api.process)
BUFFERS = BufferPool(max_bytes=4 << 30)


def new_buffer(size: int) -> memoryview:
    """`size` writable bytes, not zeroed, for a buffer about to be filled whole (a message being
    received or written): from the process's pool (BUFFERS)."""
    return BUFFERS.take(size)
