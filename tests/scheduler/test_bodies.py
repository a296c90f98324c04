"""Upload bodies kept by the replica that received them (hotstate.bodies): the shelf's bounds,
the peer port, and apply_step reading another replica's bodies, and recomputing when that
replica is gone."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from api.steps.peer_listener import PeerListener
from hotstate import bodies, keys
from hotstate.blobs import MemoryBlobStore, RedisBlobStore
from hotstate.bodies import BodyShelf, fetch_bodies, keep_body, parse_peer_key, peer_key
from scheduler.tasks.reconcile import run_reconcile, run_reconcile_job
from scheduler.tasks.steps import run_apply_step
from tests.scheduler.helpers import (
    add_devices,
    job,
    make_ctx,
    stored_state,
    submit,
    tiny_spec,
    upload_all,
)
from tests.support.proxy import TcpProxy


@pytest.fixture
def redis_store(redis_url: str) -> RedisBlobStore:
    return RedisBlobStore(redis_url)


@pytest.fixture
def replica() -> Iterator[tuple[PeerListener, BodyShelf]]:
    """Another replica's shelf, served on a real peer port."""
    shelf = BodyShelf()
    listener = PeerListener("127.0.0.1", 0, shelf=shelf)
    listener.start()
    yield listener, shelf
    listener.stop()


def test_peer_keys_round_trip_even_for_ipv6() -> None:
    assert parse_peer_key(peer_key("10.0.0.7:4100", "ab" * 16)) == ("10.0.0.7:4100", "ab" * 16)
    assert parse_peer_key(peer_key("[fd00::1]:4100", "cd" * 16)) == ("[fd00::1]:4100", "cd" * 16)
    assert parse_peer_key("job:j:body:0:xyz") is None


def test_a_shelf_not_serving_keeps_nothing() -> None:
    assert BodyShelf().put("j", 0, b"x" * 10) is None


def test_the_shelf_is_bounded_in_bytes_and_frees_what_a_later_step_makes_stale() -> None:
    shelf = BodyShelf(capacity_bytes=100)
    shelf.serve_at("127.0.0.1:1")
    a = shelf.put("j", 0, b"a" * 60)
    assert a is not None and shelf.held_bytes() == 60
    assert shelf.put("j", 0, b"b" * 60) is None  # over the bound: the caller uses Redis
    other = shelf.put("k", 0, b"k" * 30)  # another job's step 0 stays
    c = shelf.put("j", 1, b"c" * 60)  # step 1 of j: step 0 was applied, its body is freed
    assert c is not None and other is not None
    assert shelf.get(parse_peer_key(a)[1]) is None
    assert bytes(shelf.get(parse_peer_key(c)[1])) == b"c" * 60
    assert shelf.held_bytes() == 90
    shelf.discard(c)
    assert shelf.held_bytes() == 30


def test_bodies_older_than_the_ttl_are_freed() -> None:
    shelf = BodyShelf(ttl_s=0.05)
    shelf.serve_at("127.0.0.1:1")
    old = shelf.put("j", 0, b"x" * 10)
    time.sleep(0.1)
    shelf.put("k", 0, b"y")
    assert shelf.get(parse_peer_key(old)[1]) is None and shelf.held_bytes() == 1


def test_bodies_are_read_over_the_peer_port_and_a_dead_replica_is_marked_down(
        redis_store: RedisBlobStore, replica: tuple[PeerListener, BodyShelf]) -> None:
    listener, shelf = replica
    payloads = [np.random.default_rng(i).bytes(1_000_000 + i) for i in range(3)]
    refs = [shelf.put("j", 0, p) for p in payloads]
    unknown = peer_key(shelf.address, "0" * 32)
    got = fetch_bodies(redis_store, [*refs, unknown])
    assert [bytes(got[r]) for r in refs] == payloads
    assert got[unknown] is None  # a body the replica no longer has: that shard is redone
    assert not redis_store.exists(keys.peer_down(shelf.address))

    address = shelf.address
    listener.stop()  # the replica dies
    got = fetch_bodies(redis_store, refs)
    assert all(got[r] is None for r in refs)
    assert redis_store.exists(keys.peer_down(address))


def test_a_sliced_steps_task_reads_only_its_range_of_each_body(
        redis_store: RedisBlobStore, replica: tuple[PeerListener, BodyShelf]) -> None:
    """scheduler.tasks.slices: a task applying one slice reads that range of every upload, over
    the peer port or from Redis, never the whole body."""
    _, shelf = replica
    payload = np.random.default_rng(7).bytes(1_000_000)
    remote = shelf.put("j", 0, payload)
    redis_store.set("job:j:body:0:x", payload)
    pieces = [(remote, (1000, 5000)), (remote, (7, 7)), (remote, (0, 1_000_000)),
              (remote, (5, 2_000_000)),
              ("job:j:body:0:x", (999_000, 1_000_000)), ("job:j:body:0:x", (999_000, 1_000_001))]
    got = bodies.fetch_pieces(redis_store, pieces)
    assert bytes(got[pieces[0]]) == payload[1000:5000]
    assert bytes(got[pieces[1]]) == b""  # an empty range (a model without batch statistics)
    assert bytes(got[pieces[2]]) == payload  # the same connection goes on after it
    assert got[pieces[3]] is None  # past the body's end: not a piece of it
    assert bytes(got[pieces[4]]) == payload[999_000:]
    assert got[pieces[5]] is None
    assert not redis_store.exists(keys.peer_down(shelf.address))


def test_a_replica_marked_down_keeps_bodies_in_redis(
        redis_store: RedisBlobStore, monkeypatch: pytest.MonkeyPatch) -> None:
    shelf = BodyShelf()
    shelf.serve_at("127.0.0.1:9")
    monkeypatch.setattr(bodies, "SHELF", shelf)
    assert keep_body(redis_store, "j", 0, b"body", "job:j:body:0:a").startswith("peer:")
    redis_store.set(keys.peer_down("127.0.0.1:9"), b"1", ttl=60)
    assert keep_body(redis_store, "j", 0, b"body", "job:j:body:0:b") == "job:j:body:0:b"
    assert redis_store.get("job:j:body:0:b") == b"body"


def _start(ctx) -> str:
    add_devices(ctx, 2)
    job_id = submit(ctx, tiny_spec())
    run_reconcile(ctx)
    assert run_reconcile_job(ctx, job_id) == "ok"
    return job_id


def test_apply_step_reads_another_replicas_bodies_and_recomputes_when_it_is_gone(
        pg_url: str, sqlite_url: str, tmp_path: Path, redis_store: RedisBlobStore,
        replica: tuple[PeerListener, BodyShelf], monkeypatch: pytest.MonkeyPatch) -> None:
    listener, shelf = replica
    ctx = make_ctx(pg_url, tmp_path / "peer", blobs=redis_store)  # production: Postgres, Redis
    reference = make_ctx(sqlite_url, tmp_path / "ref", blobs=MemoryBlobStore())  # embedded
    job_id, ref_id = _start(ctx), _start(reference)
    applier_shelf = BodyShelf()  # this process: the worker, holding no body itself
    for step in range(2):
        monkeypatch.setattr(bodies, "SHELF", shelf)  # the replica receives the uploads
        upload_all(ctx, job_id, step)
        assert not redis_store.keys(f"job:{job_id}:body:")  # none went through Redis
        monkeypatch.setattr(bodies, "SHELF", applier_shelf)  # the worker applies
        assert run_apply_step(ctx, job_id, step) == "applied"
        upload_all(reference, ref_id, step)
        assert run_apply_step(reference, ref_id, step) == "applied"
    ours, theirs = stored_state(ctx, job_id, 2), stored_state(reference, ref_id, 2)
    assert np.array_equal(ours.params, theirs.params)  # bit for bit: the same results applied

    monkeypatch.setattr(bodies, "SHELF", shelf)
    upload_all(ctx, job_id, 2)
    listener.stop()  # the replica dies holding step 2's uploads
    monkeypatch.setattr(bodies, "SHELF", applier_shelf)
    assert run_apply_step(ctx, job_id, 2) == "incomplete"  # never a partial step
    assert job(ctx, job_id).step == 2
    assert not redis_store.keys(keys.grad_prefix(job_id, 2))  # every shard is to do again
    assert not redis_store.exists(keys.apply_claim(job_id, 2))  # re-enqueued at completion
    upload_all(ctx, job_id, 2)  # the devices upload again, to a replica that is up
    assert run_apply_step(ctx, job_id, 2) == "applied"


def test_an_address_that_is_not_the_replica_counts_as_unreachable(
        redis_store: RedisBlobStore) -> None:
    """A wrong advertised address that reaches some other HTTP service (its 404 is not "the
    body is gone"): the replica is marked down, so bodies go through Redis meanwhile."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class NotAPeer(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    other = ThreadingHTTPServer(("127.0.0.1", 0), NotAPeer)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    try:
        address = f"127.0.0.1:{other.server_address[1]}"
        key = peer_key(address, "ab" * 16)
        assert fetch_bodies(redis_store, [key]) == {key: None}
        assert redis_store.exists(keys.peer_down(address))
    finally:
        other.shutdown()
        other.server_close()


def test_a_blip_on_the_peer_link_is_retried_not_taken_for_a_dead_replica(
        redis_store: RedisBlobStore, replica: tuple[PeerListener, BodyShelf]) -> None:
    """A connection reset once (a sliced step makes P fetches of each replica, so blips come P
    times as often) is tried again: the bodies are read and no result is thrown away. Reset on
    every try, the replica is marked down as before."""
    _, shelf = replica
    proxy = TcpProxy([("127.0.0.1", int(shelf.address.rpartition(":")[2]))])
    try:
        shelf.serve_at(f"127.0.0.1:{proxy.port}")  # the address peers reach it at
        payloads = [np.random.default_rng(i).bytes(200_000) for i in range(2)]
        refs = [shelf.put("j", 0, p) for p in payloads]
        proxy.drop_next(1)
        got = bodies.fetch_pieces(redis_store, [(refs[0], (0, 1000)), (refs[1], None)])
        assert bytes(got[(refs[0], (0, 1000))]) == payloads[0][:1000]
        assert bytes(got[(refs[1], None)]) == payloads[1]
        assert not redis_store.exists(keys.peer_down(shelf.address))

        proxy.drop_next(bodies.FETCH_ATTEMPTS)
        got = fetch_bodies(redis_store, refs)
        assert all(got[r] is None for r in refs)
        assert redis_store.exists(keys.peer_down(shelf.address))
    finally:
        proxy.close()
