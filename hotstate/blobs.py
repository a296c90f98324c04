"""Hot state: weights, optimizer state and per-shard gradients (docs/contracts.md, "Hot state").

Redis in production, a process-local dict when embedded. Everything here is recomputable or
restorable from a checkpoint, so losing every key is survivable (see scheduler/tasks/recovery.py).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any, Protocol

import redis
from redis.connection import PythonRespSerializer


class BlobStore(Protocol):
    def get(self, key: str) -> bytes | None: ...

    def set(self, key: str, value: bytes, ttl: float | None = None) -> None: ...

    def set_if_absent(self, key: str, value: bytes, ttl: float | None = None) -> bool: ...

    def delete(self, *keys: str) -> None: ...

    def keys(self, prefix: str) -> list[str]: ...

    def exists(self, key: str) -> bool: ...

    def count_existing(self, keys: list[str]) -> int:
        """How many of `keys` exist (one round trip)."""
        ...

    def delete_if_equal(self, key: str, value: bytes) -> bool:
        """Delete `key` only if it still holds `value` (atomic); whether it did."""
        ...

    def get_many(self, keys: list[str]) -> list[bytes | None]: ...

    def get_range(self, key: str, start: int, length: int) -> bytes | memoryview:
        """`length` bytes of the value from `start`: fewer when the value is shorter, none
        when the key is missing."""
        ...

    def publish(self, channel: str) -> None:
        """Tell every process listening on `channel` that something changed (no payload)."""
        ...

    def notices(self, channel: str) -> Iterator[None] | None:
        """One item once listening on `channel` (a notice sent before is not replayed), then
        one per notice; raises when the connection drops. None: the store lives in this
        process, and nothing outside it can publish."""
        ...


class MemoryBlobStore:
    """A dict behind a lock; expiry is checked on read. Values are kept as given, without a
    copy: a bytearray (an upload's body) is kept as a read-only view, so its owner must not
    change it afterwards."""

    def __init__(self) -> None:
        self._data: dict[str, tuple[bytes | memoryview, float | None]] = {}
        self._lock = threading.Lock()

    def _live(self, key: str) -> bytes | None:
        item = self._data.get(key)
        if item is None:
            return None
        value, expires = item
        if expires is not None and expires <= time.monotonic():
            del self._data[key]
            return None
        return value

    @staticmethod
    def _expiry(ttl: float | None) -> float | None:
        return None if ttl is None else time.monotonic() + ttl

    def get(self, key: str) -> bytes | None:
        with self._lock:
            return self._live(key)

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        with self._lock:
            return [self._live(key) for key in keys]

    def get_range(self, key: str, start: int, length: int) -> bytes | memoryview:
        with self._lock:
            value = self._live(key)
        return memoryview(value or b"")[start:start + length]

    def set(self, key: str, value: bytes, ttl: float | None = None) -> None:
        with self._lock:
            self._data[key] = (_kept(value), self._expiry(ttl))

    def set_if_absent(self, key: str, value: bytes, ttl: float | None = None) -> bool:
        with self._lock:
            if self._live(key) is not None:
                return False
            self._data[key] = (_kept(value), self._expiry(ttl))
            return True

    def delete(self, *keys: str) -> None:
        with self._lock:
            for key in keys:
                self._data.pop(key, None)

    def keys(self, prefix: str) -> list[str]:
        with self._lock:
            return [k for k in list(self._data) if k.startswith(prefix) and self._live(k) is not None]

    def exists(self, key: str) -> bool:
        with self._lock:
            return self._live(key) is not None

    def count_existing(self, keys: list[str]) -> int:
        with self._lock:
            return sum(self._live(k) is not None for k in keys)

    def delete_if_equal(self, key: str, value: bytes) -> bool:
        with self._lock:
            held = self._live(key)
            if held is None or bytes(held) != bytes(value):
                return False
            self._data.pop(key, None)
            return True

    def flush(self) -> None:
        """Lose every key (tests: what a Redis restart without persistence does)."""
        with self._lock:
            self._data.clear()

    def publish(self, channel: str) -> None:
        pass  # in-process: hotstate.version pokes its watchers directly

    def notices(self, channel: str) -> Iterator[None] | None:
        return None


def _kept(value: bytes | bytearray | memoryview) -> bytes | memoryview:
    return value if isinstance(value, bytes) else memoryview(value).cast("B").toreadonly()


MGET_GROUP = 8


class RedisBlobStore:
    """Redis strings; `keys` uses SCAN (never KEYS) so a big keyspace does not block Redis."""

    def __init__(self, url: str) -> None:
        self.url = url
        extra = {"connection_class": _big_value_connection()} if url.startswith("redis://") else {}
        self._redis = redis.Redis.from_url(url, socket_timeout=30, health_check_interval=30,
                                           **extra)
        # compare-and-delete: a slow task must not delete what another wrote meanwhile
        self._delete_if_equal = self._redis.register_script(
            "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) "
            "end return 0")

    def get(self, key: str) -> bytes | None:
        return self._redis.get(key)

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        """MGET in groups: one round trip per group instead of per key (8 x 12.9 MB: 214 -> 161
        ms measured), and no single reply bigger than MGET_GROUP values."""
        out: list[bytes | None] = []
        for lo in range(0, len(keys), MGET_GROUP):
            out.extend(self._redis.mget(keys[lo:lo + MGET_GROUP]))
        return out

    def get_range(self, key: str, start: int, length: int) -> bytes | memoryview:
        return self._redis.getrange(key, start, start + length - 1) if length > 0 else b""

    def publish(self, channel: str) -> None:
        self._redis.publish(self._channel(channel), b"")

    def notices(self, channel: str) -> Iterator[None] | None:
        return self._notices(self._channel(channel))

    def _notices(self, channel: str) -> Iterator[None]:
        pubsub = self._redis.pubsub()
        try:
            pubsub.subscribe(channel)
            for message in pubsub.listen():  # the subscription's confirmation comes first
                if message.get("type") in ("subscribe", "message"):
                    yield None
        finally:
            pubsub.close()

    def _channel(self, name: str) -> str:
        """Channels are server-wide (not per database): named with the database, so stores on
        other databases of one server (tests, several deployments) do not wake each other."""
        return f"phalanx:{self._redis.connection_pool.connection_kwargs.get('db', 0)}:{name}"

    def set(self, key: str, value: bytes, ttl: float | None = None) -> None:
        self._redis.set(key, value, px=_ms(ttl))

    def set_if_absent(self, key: str, value: bytes, ttl: float | None = None) -> bool:
        return bool(self._redis.set(key, value, nx=True, px=_ms(ttl)))

    def delete(self, *keys: str) -> None:
        if keys:
            self._redis.delete(*keys)

    def keys(self, prefix: str) -> list[str]:
        pattern = _glob_escape(prefix) + "*"
        return [k.decode() for k in self._redis.scan_iter(match=pattern, count=1000)]

    def exists(self, key: str) -> bool:
        return bool(self._redis.exists(key))

    def count_existing(self, keys: list[str]) -> int:
        return int(self._redis.exists(*keys)) if keys else 0

    def delete_if_equal(self, key: str, value: bytes) -> bool:
        return bool(self._delete_if_equal(keys=[key], args=[value]))

    def flush(self) -> None:
        self._redis.flushdb()


def _big_value_connection() -> type:
    """A plain TCP connection that sends big values as they are.

    With hiredis installed, redis-py packs every command into one new buffer: measured, 32 ms to
    pack a 12.9 MB SET, against 15 ms for the whole SET when the value goes out uncopied (each
    gradient upload and every state the worker writes is such a SET). redis-py's own packer
    passes a value over its cutoff through as it is; replies still parse with hiredis.
    """
    class BigValueConnection(redis.Connection):
        def _construct_command_packer(self, packer: Any) -> Any:
            return packer or PythonRespSerializer(self._buffer_cutoff, self.encoder.encode)

    return BigValueConnection


def _ms(ttl: float | None) -> int | None:
    return None if ttl is None else max(1, int(ttl * 1000))


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)


_STORES: dict[str, BlobStore] = {}
_STORES_LOCK = threading.Lock()


def blob_store_for(redis_url: str | None) -> BlobStore:
    """One store per process and URL (None: in memory), so the embedded API and worker threads
    share one dict."""
    key = redis_url or "memory://"
    with _STORES_LOCK:
        store = _STORES.get(key)
        if store is None:
            store = RedisBlobStore(key) if redis_url else MemoryBlobStore()
            _STORES[key] = store
        return store
