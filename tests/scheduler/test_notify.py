"""The version key that wakes long polls."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from hotstate.blobs import MemoryBlobStore
from hotstate.version import VersionWatch, bump_version, current_version
from tests.support.proxy import TcpProxy


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


def _bump_in_another_process(redis_url: str) -> None:
    """What a worker or another replica does after a step: a real separate process."""
    code = ("import sys; from hotstate.blobs import RedisBlobStore; "
            "from hotstate.version import bump_version; bump_version(RedisBlobStore(sys.argv[1]))")
    subprocess.run([sys.executable, "-c", code, redis_url], check=True, timeout=60,
                   cwd=Path(__file__).resolve().parents[2])


def _wait_for_a_bump(watch: VersionWatch, bump: Callable[[], None],
                     timeout: float = 30.0) -> tuple[bytes, bytes]:
    async def wait() -> tuple[bytes, bytes]:
        since = watch.snapshot()
        deadline = time.monotonic() + 10
        while not watch._listening and time.monotonic() < deadline:  # subscribed first
            await asyncio.sleep(0.02)
        bumper = threading.Thread(target=bump)
        bumper.start()
        seen = await watch.wait_change(since, timeout=timeout)
        bumper.join()
        return since, seen

    return asyncio.run(wait())


def test_a_bump_in_another_process_wakes_waiters_by_its_notice_not_by_polling(redis_url) -> None:
    """The watcher's poll is 60 s here (longer than the wait): only the notice the bumping
    process publishes on Redis can wake the waiter with the new value."""
    from hotstate.blobs import RedisBlobStore

    blobs = RedisBlobStore(redis_url)
    watch = VersionWatch(blobs, interval_s=60.0)
    since, seen = _wait_for_a_bump(watch, lambda: _bump_in_another_process(redis_url))
    assert seen != since and seen  # the bumped value (or a later one), read once woken


def test_the_watcher_listens_again_after_its_connection_to_redis_drops(redis_url) -> None:
    """Redis restarting (here: every connection through a proxy reset) ends the subscription;
    the watcher subscribes again and the next bump's notice wakes a waiter (poll: 60 s)."""
    from hotstate.blobs import RedisBlobStore
    from hotstate.version import RESUBSCRIBE_S

    host, _, rest = redis_url.removeprefix("redis://").partition(":")
    port, _, db = rest.partition("/")
    proxy = TcpProxy([(host, int(port))])
    try:
        watched = RedisBlobStore(proxy.redis_url(int(db)))
        watch = VersionWatch(watched, interval_s=60.0)
        since, seen = _wait_for_a_bump(watch, lambda: _bump_in_another_process(redis_url))
        assert seen != since
        proxy.cut()
        deadline = time.monotonic() + 10
        while watch._listening and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not watch._listening  # the drop was noticed
        proxy.heal()
        time.sleep(RESUBSCRIBE_S)
        since, seen = _wait_for_a_bump(watch, lambda: _bump_in_another_process(redis_url))
        assert seen != since and seen
    finally:
        proxy.close()


def test_notices_of_stores_on_different_databases_do_not_mix() -> None:
    """Redis channels are server-wide: each database's bumps go on a channel of its own."""
    from hotstate.blobs import RedisBlobStore

    one, two = RedisBlobStore("redis://127.0.0.1:1/3"), RedisBlobStore("redis://127.0.0.1:1/4")
    assert one._channel("sched:version") != two._channel("sched:version")
