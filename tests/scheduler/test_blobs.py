"""The BlobStore contract, on Redis and in memory alike; and the hot-state codec."""

from __future__ import annotations

import time
from collections.abc import Iterator

import numpy as np
import pytest

from engine.step import TrainState
from hotstate.blobs import MGET_GROUP, BlobStore, MemoryBlobStore, RedisBlobStore
from hotstate.locks import acquire, release
from hotstate.trainstate import StateError, decode_state, encode_state, read_weights


@pytest.fixture(params=["memory", "redis"])
def store(request: pytest.FixtureRequest) -> Iterator[BlobStore]:
    if request.param == "memory":
        yield MemoryBlobStore()
    else:
        yield RedisBlobStore(request.getfixturevalue("redis_url"))


def test_set_get_delete(store: BlobStore) -> None:
    assert store.get("a") is None
    store.set("a", b"1")
    assert store.get("a") == b"1" and store.exists("a")
    store.delete("a", "missing")
    assert store.get("a") is None and not store.exists("a")


def test_get_many_answers_in_order_with_none_for_missing_across_groups(store: BlobStore) -> None:
    names = [f"g:{i}" for i in range(MGET_GROUP * 2 + 3)]
    for i, name in enumerate(names):
        if i % 5:
            store.set(name, f"v{i}".encode())
    assert store.get_many(names) == [None if i % 5 == 0 else f"v{i}".encode()
                                     for i in range(len(names))]
    assert store.get_many([]) == []


def test_get_range_reads_part_of_a_value_and_nothing_of_a_missing_key(store: BlobStore) -> None:
    store.set("r", bytes(range(100)))
    assert bytes(store.get_range("r", 10, 5)) == bytes(range(10, 15))
    assert bytes(store.get_range("r", 95, 10)) == bytes(range(95, 100))  # shorter at the end
    assert bytes(store.get_range("r", 0, 0)) == b""
    assert bytes(store.get_range("missing", 0, 10)) == b""


def test_first_set_if_absent_wins(store: BlobStore) -> None:
    assert store.set_if_absent("g", b"first")
    assert not store.set_if_absent("g", b"second")
    assert store.get("g") == b"first"


def test_existing_keys_are_counted_and_deleted_only_while_they_hold_what_was_read(
        store: BlobStore) -> None:
    store.set("a", b"1")
    store.set("b", b"2")
    assert store.count_existing(["a", "b", "c"]) == 2 and store.count_existing([]) == 0
    assert not store.delete_if_equal("a", b"other")  # rewritten meanwhile: kept
    assert store.get("a") == b"1"
    assert store.delete_if_equal("a", b"1") and store.get("a") is None
    assert not store.delete_if_equal("gone", b"1")


def test_keys_by_prefix_even_with_glob_characters(store: BlobStore) -> None:
    for key in ("job:a:grad:1:0", "job:a:grad:1:1", "job:a:grad:10:0", "job:b:grad:1:0", "job:[x]:1"):
        store.set(key, b"x")
    assert sorted(store.keys("job:a:grad:1:")) == ["job:a:grad:1:0", "job:a:grad:1:1"]
    assert store.keys("job:[x]:") == ["job:[x]:1"]


def test_ttl_expires(store: BlobStore) -> None:
    store.set("t", b"1", ttl=0.05)
    assert store.set_if_absent("u", b"1", ttl=0.05)
    deadline = time.monotonic() + 5
    while (store.exists("t") or store.exists("u")) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert store.get("t") is None and store.set_if_absent("u", b"2")


def test_a_lock_is_held_once_and_freed_by_its_holder_only(store: BlobStore) -> None:
    token = acquire(store, "lock", ttl=10)
    assert token and acquire(store, "lock", ttl=10) is None
    release(store, "lock", "someone-else")
    assert store.exists("lock")
    release(store, "lock", token)
    assert acquire(store, "lock", ttl=10)


@pytest.mark.parametrize("slots", [1, 2], ids=["sgd-momentum", "adamw-two-moments"])
def test_state_round_trips_exactly(slots: int) -> None:
    rng = np.random.default_rng(0)
    state = TrainState(7, rng.standard_normal(1000).astype(np.float32),
                       rng.standard_normal(slots * 1000).astype(np.float32),
                       rng.standard_normal(10).astype(np.float32))
    back = decode_state(encode_state(state), expect_step=7)
    assert back.step == 7
    for a, b in ((state.params, back.params), (state.opt_state, back.opt_state),
                 (state.buffers, back.buffers)):
        assert np.array_equal(a, b)
    with pytest.raises(StateError):
        decode_state(encode_state(state), expect_step=8)
    with pytest.raises(StateError):
        decode_state(encode_state(state)[:-4])


def test_a_state_written_before_optimizer_slots_still_decodes() -> None:
    """A job running across the upgrade: its version-1 state (one momentum vector, a header
    without the slot count) reads as before, and its weights by range too."""
    import struct

    rng = np.random.default_rng(1)
    params, momentum, buffers = (rng.standard_normal(n).astype("<f4") for n in (50, 50, 4))
    old = struct.pack("<6sQQQ", b"PHLXS1", 3, 50, 4) + params.tobytes() + momentum.tobytes() \
        + buffers.tobytes()
    back = decode_state(old, expect_step=3)
    assert np.array_equal(back.opt_state, momentum) and np.array_equal(back.buffers, buffers)
    store = MemoryBlobStore()
    store.set("k", old)
    weights = read_weights(store, "k", expect_step=3)
    assert weights is not None
    assert np.array_equal(weights[0], params) and np.array_equal(weights[1], buffers)


def test_redis_sends_a_big_value_uncopied_and_it_round_trips(redis_url: str) -> None:
    """The packer in use hands a big value to the socket as the same object (hiredis's copies
    it into one new buffer: 32 ms per 12.9 MB SET, measured); the value arrives intact."""
    store = RedisBlobStore(redis_url)
    value = np.random.default_rng(0).bytes(3 * 1024 * 1024)
    conn = store._redis.connection_pool.get_connection()
    try:
        assert any(part is value for part in conn.pack_command("SET", "k", value))
    finally:
        store._redis.connection_pool.release(conn)
    store.set("big", value)
    assert store.get("big") == value and store.get_many(["big"]) == [value]
