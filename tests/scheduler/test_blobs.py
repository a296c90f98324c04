"""The BlobStore contract, on Redis and in memory alike; and the hot-state codec."""

from __future__ import annotations

import time

import numpy as np
import pytest

from engine.step import TrainState
from hotstate.blobs import MGET_GROUP, PART_BYTES, BlobStore, MemoryBlobStore, RedisBlobStore
from hotstate.locks import acquire, release
from hotstate.trainstate import StateError, decode_state, encode_state, read_weights


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


def test_which_exist_answers_each_key_and_incr_counts_from_zero_keeping_a_ttl(
        store: BlobStore) -> None:
    store.set("a", b"1")
    assert store.which_exist(["a", "b", "a"]) == [True, False, True] and store.which_exist([]) == []
    assert store.incr("n", 3) == 3 and store.incr("n", 0) == 3 and store.incr("n", 2) == 5
    store.set("short", b"7", ttl=0.05)
    assert store.incr("short", 1) == 8  # like INCRBY: the key keeps its expiry
    time.sleep(0.1)
    assert store.get("short") is None and store.incr("short", 1) == 1


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


# -- big values in parts (Redis) --------------------------------------------------------------
def _raw_sizes(store: RedisBlobStore) -> dict[str, int]:
    raw = store._redis  # strings only: a job's step index (keys.step_index) is a sorted set
    return {k.decode(): int(raw.strlen(k)) for k in raw.scan_iter(count=1000, _type="string")}


def test_a_big_value_is_stored_in_parts_no_string_over_part_bytes_and_read_back_whole(
        redis_url: str) -> None:
    """Redis gets no string of 8 MiB or more, which jemalloc hands back to the kernel at once
    (6,275 fresh page faults for each 25.7 MB state written, measured): every value reads back
    whole, by get, get_many and get_range across part boundaries."""
    store = RedisBlobStore(redis_url)
    big = np.random.default_rng(1).bytes(5 * PART_BYTES + 12345)
    store.set("job:j:state:3:n", big)
    store.set("small", b"x")
    sizes = _raw_sizes(store)
    assert max(sizes.values()) <= PART_BYTES and sum(sizes.values()) >= len(big)
    assert len(sizes) == 2 + 6  # two heads and six parts
    assert store.get("job:j:state:3:n") == big
    assert store.get_many(["small", "job:j:state:3:n", "none"]) == [b"x", big, None]
    for start, length in ((0, 40), (PART_BYTES - 7, 20), (PART_BYTES, PART_BYTES),
                          (3 * PART_BYTES - 1, 2 * PART_BYTES + 2), (len(big) - 5, 50),
                          (len(big), 10), (0, len(big))):
        assert bytes(store.get_range("job:j:state:3:n", start, length)) == \
            big[start:start + length], (start, length)
    assert store.keys("job:j:") == ["job:j:state:3:n"]  # never the parts
    assert store.exists("job:j:state:3:n") and store.count_existing(["job:j:state:3:n"]) == 1
    store.delete("job:j:state:3:n", "small")
    assert _raw_sizes(store) == {}  # the parts went with their head


def test_parts_are_written_once_first_wins_and_overwrites_leave_no_parts_behind(
        redis_url: str) -> None:
    store = RedisBlobStore(redis_url)
    rng = np.random.default_rng(2)
    first, second, third = (rng.bytes(2 * PART_BYTES + k) for k in (1, 2, 3))
    assert store.set_if_absent("g", first) and not store.set_if_absent("g", second)
    assert store.get("g") == first and len(_raw_sizes(store)) == 1 + 3  # the loser's parts gone
    store.set("g", third)
    assert store.get("g") == third and len(_raw_sizes(store)) == 1 + 3  # first's parts gone
    store.set("g", b"small now")
    assert store.get("g") == b"small now" and _raw_sizes(store) == {"g": 9}


def test_a_write_retried_after_its_reply_was_lost_is_done_once(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """redis-py sends a MULTI again when the connection drops before EXEC's reply: the same
    parts and manifest arrive twice; the value must stay whole and count as written."""
    import hotstate.blobs as blobs

    store = RedisBlobStore(redis_url)
    value = np.random.default_rng(3).bytes(PART_BYTES + 99)
    monkeypatch.setattr(blobs.secrets, "token_hex", lambda n: "ab" * n)  # the same write
    assert store._put_parts("n", value, None, nx=True)
    assert store._put_parts("n", value, None, nx=True)  # the retry: ours, so True
    store._put_parts("s", value, None, nx=False)
    store._put_parts("s", value, None, nx=False)
    assert store.get("n") == value and store.get("s") == value
    assert len(_raw_sizes(store)) == 2 * (1 + 2)


def test_a_big_value_is_deleted_only_while_it_holds_what_was_read(redis_url: str) -> None:
    store = RedisBlobStore(redis_url)
    rng = np.random.default_rng(4)
    value, other = rng.bytes(3 * PART_BYTES), rng.bytes(3 * PART_BYTES)
    store.set("r", value)
    assert not store.delete_if_equal("r", other) and store.get("r") == value
    assert store.delete_if_equal("r", value) and _raw_sizes(store) == {}


def test_a_reader_whose_value_was_overwritten_meanwhile_reads_the_new_one(
        redis_url: str) -> None:
    store = RedisBlobStore(redis_url)
    rng = np.random.default_rng(5)
    old, new = rng.bytes(PART_BYTES + 1), rng.bytes(PART_BYTES + 2)
    store.set("w", old)
    head = store._redis.get("w")  # a reader has the head; a writer replaces the value
    store.set("w", new)
    assert store._whole("w", head) == new


def test_a_value_that_looks_like_a_manifest_round_trips_and_a_lost_part_reads_as_missing(
        redis_url: str) -> None:
    from hotstate.blobs import _PARTS_MAGIC

    store = RedisBlobStore(redis_url)
    tricky = _PARTS_MAGIC + b"0123456789abcdef:1:5:5"  # a client's bytes, not a manifest
    store.set("t", tricky)
    assert store.get("t") == tricky and bytes(store.get_range("t", 0, 4)) == tricky[:4]
    store.set("b", b"\1" * (PART_BYTES + 1), ttl=60)
    raw = store._redis
    part = next(k for k in raw.scan_iter(match="b:~*"))
    assert 0 < raw.pttl(part) <= 60_000 and 0 < raw.pttl("b") <= 60_000  # together
    raw.delete(part)  # evicted
    assert store.get("b") is None and store.get_many(["b"]) == [None]
    assert not store.exists("b")  # the broken head dropped, with what was left of it
    assert not [k for k in _raw_sizes(store) if k.startswith("b")]
    assert store.set_if_absent("b", b"\2" * (PART_BYTES + 1))  # so it can be stored again
    assert store.get("b") == b"\2" * (PART_BYTES + 1)


def test_listing_a_steps_keys_in_a_fleet_sized_keyspace_is_one_scan(redis_url: str) -> None:
    """Every upload and work answer lists its step's results: with a few thousand other keys
    (per-device keys grow with the fleet) that is one SCAN round trip, not one per thousand."""
    store = RedisBlobStore(redis_url)
    raw = store._redis
    pipe = raw.pipeline(transaction=False)
    for i in range(5000):  # 3 keys a device and job, ~1,700 phones
        pipe.set(f"job:j:lat:dev{i}", b"0.1")
    pipe.execute()
    store.set("job:j:grad:7:0", b"ref")

    calls: list[int] = []  # counted here: the server's command stats include other tests'
    scan = raw.scan
    raw.scan = lambda *a, **kw: calls.append(1) or scan(*a, **kw)  # type: ignore[method-assign]
    assert store.keys("job:j:grad:7:") == ["job:j:grad:7:0"]
    assert len(calls) == 1


def test_a_steps_stored_results_are_found_without_walking_the_keyspace(redis_url: str) -> None:
    """Every upload and work answer asks which of its step's results are stored: asked of the
    reduction tree's possible keys in one round trip, never by a SCAN of the keyspace (which
    grows with the fleet: per-device keys, other jobs, other steps)."""
    from engine.tree import nodes
    from hotstate import keys
    from hotstate.gradstore import stored_nodes, uploaded_shards

    store = RedisBlobStore(redis_url)
    raw = store._redis
    pipe = raw.pipeline(transaction=False)
    for i in range(5000):
        pipe.set(f"job:j:lat:dev{i}", b"0.1")
    pipe.execute()
    shards = 138
    assert len(nodes(shards)) == 2 * shards - 1 and len(set(nodes(shards))) == 2 * shards - 1
    stored = [(0, 1), (64, 128), (130, 131), (136, 138)]
    for lo, hi in stored:
        store.set(keys.grad("j", 7, lo, hi - lo), b"ref")
    store.set(keys.grad("j", 8, 2), b"ref")  # another step's
    store.set(keys.grad("j", 7, 2, 2), b"\1" * (PART_BYTES + 5))  # a whole result, in parts

    calls: list[int] = []
    scan = raw.scan
    raw.scan = lambda *a, **kw: calls.append(1) or scan(*a, **kw)  # type: ignore[method-assign]
    found = stored_nodes(store, "j", 7, shards)
    assert set(found) == {*stored, (2, 4)} and found[(64, 128)] == keys.grad("j", 7, 64, 64)
    assert uploaded_shards(store, "j", 7, shards) == {0, 2, 3, *range(64, 128), 130, 136, 137}
    assert uploaded_shards(store, "j", 7, shards, over={1, 65, 131, 137}) == {65, 137}
    assert calls == []
    assert store.which_exist(["job:j:lat:dev1", "nope", keys.grad("j", 7, 2, 2)]) == \
        [True, False, True]
    assert store.which_exist([]) == []
