"""Model-sized byte buffers, handed out again once nothing references them.

Every step a server receives an upload per phone and makes a state and a weights message, each a
buffer of the same few sizes (12.9 MB a mobilenet_v1 vector, 102 MB a resnet50 one). Allocated
fresh each time, the kernel hands out and zeroes new pages for each one (glibc's malloc maps
blocks above 32 MiB afresh whatever its tunables, and gives smaller ones back now and then:
engine.memory): page faults and clear_page on the step's critical path. A pool keeps the buffers
it made and hands one out again when the only reference left to it is the pool's own: a view of
it, an array made from it or a memoryview held anywhere keeps it out of reach, so a buffer is never
reused while anything can still read or write it. The pool holds at most `max_bytes`, and lets go
of a buffer not handed out for `idle_s` seconds (checked whenever a buffer is asked for).
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

POOLED_MIN_BYTES = 1 << 20  # below this malloc's own free lists do the job
IDLE_S = 60.0


@dataclass(slots=True)
class _Pooled:
    array: np.ndarray
    last_out: float


def _fresh(size: int) -> memoryview:
    # numpy's allocator, not bytearray (which zero-fills through calloc): 5.2-6.5 ms against
    # 1.1-1.7 ms for 12.9 MB buffers alive eight at a time (docs/benchmarks.md)
    return memoryview(np.empty(size, np.uint8)).cast("B")


class BufferPool:
    def __init__(self, max_bytes: int, idle_s: float = IDLE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_bytes, self.idle_s, self._clock = max_bytes, idle_s, clock
        self._lock = threading.Lock()
        self._by_size: dict[int, list[_Pooled]] = {}
        self.held_bytes = 0
        self.reused = 0  # buffers handed out again (a page fault and a zeroing saved per page)

    def take(self, size: int) -> memoryview:
        """`size` writable bytes, not zeroed (any earlier content may be there)."""
        if size < POOLED_MIN_BYTES or self.max_bytes <= 0:
            return _fresh(size)
        now = self._clock()
        with self._lock:
            self._let_go_idle(now)
            for pooled in self._by_size.get(size, ()):
                # two references: the pool's and getrefcount's argument; anything else that
                # can reach the bytes (a memoryview, a view, an array on them) holds a third
                if sys.getrefcount(pooled.array) == 2:
                    pooled.last_out = now
                    self.reused += 1
                    return memoryview(pooled.array).cast("B")
            if self.held_bytes + size > self.max_bytes:
                return _fresh(size)
            array = np.empty(size, np.uint8)
            self._by_size.setdefault(size, []).append(_Pooled(array, now))
            self.held_bytes += size
            return memoryview(array).cast("B")

    def _let_go_idle(self, now: float) -> None:
        """Buffers not handed out for idle_s leave the pool (freed once nothing else holds
        them): a finished job's sizes are not kept for good."""
        for size, pooled in list(self._by_size.items()):
            kept = [p for p in pooled if now - p.last_out < self.idle_s]
            self.held_bytes -= size * (len(pooled) - len(kept))
            if kept:
                self._by_size[size] = kept
            else:
                del self._by_size[size]


# the process's pool: a server and a worker size it from their settings (api.process)
BUFFERS = BufferPool(max_bytes=1 << 30)


def new_buffer(size: int) -> memoryview:
    """`size` writable bytes, not zeroed, for a buffer about to be filled whole (a message being
    received or written): from the process's pool (BUFFERS)."""
    return BUFFERS.take(size)
