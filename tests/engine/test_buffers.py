"""Model-sized buffers handed out again, never while anything can still reach them (wire.buffers)."""

from __future__ import annotations

import threading
import time

import numpy as np

from wire.buffers import POOLED_MIN_BYTES, BufferPool

SIZE = 2 * POOLED_MIN_BYTES


def address(view: memoryview) -> int:
    return np.frombuffer(view, np.uint8).ctypes.data


def test_a_buffer_nothing_references_is_handed_out_again_and_one_still_reachable_never() -> None:
    pool = BufferPool(max_bytes=1 << 30)
    first = pool.take(SIZE)
    where = address(first)
    assert address(pool.take(SIZE)) != where  # held: another buffer (that one is dropped at once)
    first[:4] = b"abcd"
    # every way a caller keeps a received body or a message: the view itself, a slice of it, a
    # read-only view (the memory blob store's), a numpy array on it (decoded results)
    for keeps in (lambda v: v, lambda v: v[100:200], lambda v: v.toreadonly(),
                  lambda v: np.frombuffer(v, np.float32)):
        kept = keeps(first)
        del first
        other = pool.take(SIZE)
        assert address(other) != where, keeps
        del other, kept
        first = pool.take(SIZE)
        assert address(first) == where  # nothing else holds it: handed out again, not zeroed
        assert bytes(first[:4]) == b"abcd"
    assert pool.reused >= 5


def test_the_pool_holds_at_most_its_bytes_and_leaves_small_buffers_to_malloc() -> None:
    pool = BufferPool(max_bytes=2 * SIZE)
    held = [pool.take(SIZE) for _ in range(3)]  # the third is past the limit: not pooled
    assert pool.held_bytes == 2 * SIZE
    unpooled = address(held.pop())
    held.clear()
    again = [pool.take(SIZE) for _ in range(2)]
    assert pool.reused == 2 and unpooled not in {address(v) for v in again}
    small = pool.take(POOLED_MIN_BYTES - 1)
    assert len(small) == POOLED_MIN_BYTES - 1 and pool.held_bytes == 2 * SIZE
    off = BufferPool(max_bytes=0)  # PHALANX_BUFFER_POOL_MB=0
    first = off.take(SIZE)
    where = address(first)
    del first
    assert off.held_bytes == 0 and off.reused == 0 and len(off.take(SIZE)) == SIZE
    assert where  # a fresh buffer each time


def test_a_size_not_asked_for_a_while_leaves_the_pool() -> None:
    """A finished job's buffers are not kept for good: idle_s after one was last handed out, the
    pool lets go of it (freed once nothing else holds it)."""
    now = [0.0]
    pool = BufferPool(max_bytes=1 << 30, idle_s=60.0, clock=lambda: now[0])
    pool.take(SIZE)
    pool.take(3 * POOLED_MIN_BYTES)
    assert pool.held_bytes == 5 * POOLED_MIN_BYTES
    now[0] = 59.0
    pool.take(SIZE)  # handed out again: its clock restarts
    now[0] = 100.0
    pool.take(POOLED_MIN_BYTES)
    pool.let_go_idle()  # what the pool's thread does every idle_s / 2
    assert pool.held_bytes == SIZE + POOLED_MIN_BYTES


def test_a_buffer_in_use_past_the_idle_time_stays_pooled_and_sizes_share_a_class() -> None:
    """A state kept through a long step is in use, not idle; an upload a few bytes longer than the
    last (its header's digits) takes the same buffer."""
    now = [0.0]
    pool = BufferPool(max_bytes=1 << 30, idle_s=60.0, clock=lambda: now[0])
    held = pool.take(SIZE)
    where = address(held)
    now[0] = 500.0
    pool.take(POOLED_MIN_BYTES)
    pool.let_go_idle()
    assert pool.held_bytes == SIZE + POOLED_MIN_BYTES  # still the pool's, though held for 500 s
    del held
    again = pool.take(SIZE - 100)
    assert address(again) == where and len(again) == SIZE - 100
    del again
    longer = pool.take(SIZE - 36)  # same 64 KiB class
    assert address(longer) == where and len(longer) == SIZE - 36


def test_a_pool_nobody_asks_lets_go_of_its_buffers_on_its_own() -> None:
    """After a job's last step nothing asks for a buffer again: the pool's own thread lets go of
    the idle ones (and ends; the next buffer made starts it again)."""
    pool = BufferPool(max_bytes=1 << 30, idle_s=0.05)
    pool.take(SIZE)
    deadline = time.monotonic() + 30
    while pool.held_bytes and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.held_bytes == 0
    pool.take(SIZE)
    assert pool.held_bytes == SIZE  # pooled again
    while pool.held_bytes and time.monotonic() < deadline:
        time.sleep(0.01)
    assert pool.held_bytes == 0


def test_threads_taking_and_dropping_buffers_never_share_one() -> None:
    """Each thread writes its mark over the whole buffer and checks it before dropping it: a
    buffer handed to two holders at once would show the other's mark."""
    pool = BufferPool(max_bytes=6 * SIZE)
    wrong: list[str] = []

    def work(mark: int) -> None:
        for _ in range(200):
            view = np.frombuffer(pool.take(SIZE), np.uint8)
            view[:] = mark
            time.sleep(0)  # let the others run while this one holds it
            if not (view[:: 4096] == mark).all() or view[-1] != mark:
                wrong.append(f"thread {mark} saw another's bytes")

    threads = [threading.Thread(target=work, args=(k,)) for k in range(1, 9)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not wrong, wrong[:3]
    assert pool.reused > 0 and pool.held_bytes <= 6 * SIZE
