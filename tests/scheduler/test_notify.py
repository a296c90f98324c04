"""The version key that wakes long polls."""

from __future__ import annotations

import asyncio
import threading

from hotstate.blobs import MemoryBlobStore
from hotstate.version import VersionWatch, bump_version, current_version


def test_a_bump_in_the_same_process_wakes_waiters_without_waiting_for_a_poll() -> None:
    """The watcher reads the key only every `interval_s` (here 60 s, longer than the wait);
    a bump made by another thread of its process (apply_step in embedded mode) still wakes
    the waiter with the new value."""
    blobs = MemoryBlobStore()
    watch = VersionWatch(blobs, interval_s=60.0)

    async def wait() -> tuple[bytes, bytes]:
        since = watch.snapshot()
        await asyncio.sleep(0.05)  # the watcher's first read happens at its first interval
        bumper = threading.Timer(0.2, bump_version, args=(blobs,))
        bumper.start()
        seen = await watch.wait_change(since, timeout=20.0)
        bumper.join()
        return since, seen

    since, seen = asyncio.run(wait())
    assert seen != since and seen == current_version(blobs)


def test_without_a_bump_the_wait_times_out_with_the_old_value() -> None:
    blobs = MemoryBlobStore()
    watch = VersionWatch(blobs, interval_s=0.01)

    async def wait() -> tuple[bytes, bytes]:
        since = watch.snapshot()
        return since, await watch.wait_change(since, timeout=0.1)

    since, seen = asyncio.run(wait())
    assert seen == since


def test_a_watcher_of_an_in_process_store_polls_rarely_and_of_redis_often() -> None:
    from hotstate.blobs import RedisBlobStore
    from hotstate.version import LOCAL_POLL_S

    assert VersionWatch.for_store(MemoryBlobStore(), 0.005).interval_s == LOCAL_POLL_S
    redis_store = RedisBlobStore("redis://127.0.0.1:1/0")  # never contacted here
    assert VersionWatch.for_store(redis_store, 0.005).interval_s == 0.005
