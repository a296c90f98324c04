"""A job's per-step keys are found through its step index (keys.step_index), never by a SCAN of
the keyspace (issue 45 item 2): the index holds whatever is stored, a deleted key leaves it in
the same transaction, and an entry whose key is gone, or a key it lacks, stalls no step."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis

from domain.store.db import transaction
from domain.store.models import Job
from hotstate import keys
from hotstate.blobs import PART_BYTES, BlobStore, MemoryBlobStore, RedisBlobStore
from scheduler.context import SchedulerContext
from scheduler.tasks.reconcile import run_reconcile_job
from scheduler.tasks.recovery import drop_step_keys
from scheduler.tasks.steps import run_apply_step
from tests.scheduler.helpers import run_to, start_job, store_param_ctx, upload_all


@pytest.fixture(params=["memory", "redis"])
def ctx(request: pytest.FixtureRequest, sqlite_url: str, tmp_path: Path) -> SchedulerContext:
    """The database is not what is tested here: SQLite only; both hot-state stores."""
    return store_param_ctx(request, sqlite_url, tmp_path)


def index_gone(store: BlobStore, job_id: str) -> bool:
    """Nothing indexed for the job, and on Redis not even the (emptied) sorted set."""
    if isinstance(store, RedisBlobStore):
        return not store._redis.exists(keys.step_index(job_id))
    return store.step_keys(job_id) == []


def count_listings(store: BlobStore, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every keys() call, and on Redis every SCAN however it is sent, from now on."""
    calls: list[str] = []
    listing = store.keys
    monkeypatch.setattr(store, "keys", lambda prefix: calls.append(prefix) or listing(prefix))
    if isinstance(store, RedisBlobStore):
        scan = store._redis.scan
        monkeypatch.setattr(store._redis, "scan",
                            lambda *a, **kw: calls.append("SCAN") or scan(*a, **kw))
    return calls


def write_unindexed(store: BlobStore, key: str) -> None:
    """A key stored without its index entry: what a write cut between the two would leave
    (the store makes that impossible), or a server from before the index wrote."""
    if isinstance(store, RedisBlobStore):
        store._redis.set(key, b"x")
    else:
        assert isinstance(store, MemoryBlobStore)
        store._data[key] = (b"x", None)


# -- the store ---------------------------------------------------------------------------------

def test_a_steps_keys_join_the_index_as_written_and_leave_it_as_deleted(store: BlobStore) -> None:
    body = keys.upload_body("j", 3, "u1")
    written = [keys.grad("j", 3, 0), keys.grad("j", 3, 2, 2), keys.uploader("j", 3, 0, 1)]
    for key in written:
        store.set(key, b"r")
    assert store.set_if_absent(body, b"body") and not store.set_if_absent(body, b"again")
    assert store.incr(keys.covered("j", 3), 2) == 2
    state = keys.state("j", 4, "n1")
    store.set(state, b"s")
    store.set(keys.latency("j", "dev1"), b"0.1")  # per device, not per step: never indexed
    store.set(keys.grad("k", 3, 0), b"r")  # another job's

    step3 = {*written, body, keys.covered("j", 3)}
    assert set(store.step_keys("j", 0, 4)) == step3 and store.step_keys("j", 4) == [state]
    assert set(store.step_keys("j")) == {*step3, state} and store.step_keys("k") == [
        keys.grad("k", 3, 0)]
    assert store.step_keys("j", 5) == [] and store.step_keys("nobody") == []

    store.delete(keys.grad("j", 3, 0))  # a result deleted leaves the index with it
    assert keys.grad("j", 3, 0) not in store.step_keys("j")
    assert not store.delete_if_equal(body, b"other") and body in store.step_keys("j")
    assert store.delete_if_equal(body, b"body") and body not in store.step_keys("j")

    store.delete(*store.step_keys("j"))
    assert store.step_keys("j") == [] and index_gone(store, "j")
    assert store.get(keys.latency("j", "dev1")) == b"0.1"


def test_a_key_gone_without_a_delete_leaves_an_entry_that_deleting_it_drops(
        store: BlobStore) -> None:
    claim = keys.apply_claim("j", 5)
    store.set(claim, b"1", ttl=0.05)
    deadline = time.monotonic() + 5
    while store.exists(claim) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not store.exists(claim) and store.step_keys("j") == [claim]  # expired: stale
    store.delete(claim)
    assert store.step_keys("j") == [] and index_gone(store, "j")


def test_a_value_in_parts_is_indexed_by_its_head_and_goes_whole(redis_url: str) -> None:
    store = RedisBlobStore(redis_url)
    head = keys.state("j", 2, "n")
    big = b"\1" * (2 * PART_BYTES + 3)
    store.set(head, big)
    assert store.step_keys("j") == [head]
    assert not store.set_if_absent(head, big) and store.step_keys("j") == [head]
    store.delete(*store.step_keys("j"))
    assert store._redis.dbsize() == 0  # the parts, the head and the emptied index


def test_a_writer_that_dies_before_its_index_entry_stores_nothing(
        redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The key and its entry are one MULTI/EXEC: cut between the two, neither is stored (no
    key the index lacks, so none that a step's drop would leave behind)."""
    store = RedisBlobStore(redis_url)

    def crash(*args: object, **kwargs: object) -> None:
        raise ConnectionError("the worker died here")

    monkeypatch.setattr(redis.client.Pipeline, "zadd", crash)
    for write in (lambda: store.set(keys.grad("j", 1, 0), b"r"),
                  lambda: store.set(keys.state("j", 1, "n"), b"\2" * (PART_BYTES + 1)),
                  lambda: store.set_if_absent(keys.upload_body("j", 1, "u"), b"b"),
                  lambda: store.incr(keys.covered("j", 1), 1)):
        with pytest.raises(ConnectionError):
            write()
    assert store._redis.dbsize() == 0


# -- the scheduler ------------------------------------------------------------------------------

def test_an_applied_step_leaves_no_key_of_its_step_and_lists_no_keyspace(
        ctx: SchedulerContext, monkeypatch: pytest.MonkeyPatch) -> None:
    job_id = start_job(ctx)
    listings = count_listings(ctx.blobs, monkeypatch)
    for t in range(3):
        assert run_reconcile_job(ctx, job_id) == "ok"  # its drop too: no listing
        upload_all(ctx, job_id, t)
        assert keys.grad(job_id, t, 0) in ctx.blobs.step_keys(job_id, t, t + 1)
        assert run_apply_step(ctx, job_id, t) == "applied"
        assert ctx.blobs.step_keys(job_id, 0, t + 1) == []
        assert {keys.step_of_key(k) for k in ctx.blobs.step_keys(job_id)} == {t + 1}
    assert listings == []
    monkeypatch.undo()
    left = {keys.step_of_key(k) for k in ctx.blobs.keys(keys.job_prefix(job_id))}
    assert left - {None} == {3}  # scanned once, here: of the steps, only the state the job is at


def test_a_result_deleted_leaves_the_index_and_its_step_applies_once_uploaded_again(
        ctx: SchedulerContext) -> None:
    job_id = start_job(ctx)
    upload_all(ctx, job_id, 0)
    lost = keys.grad(job_id, 0, 1)
    ctx.blobs.delete(lost, keys.covered(job_id, 0))  # as an audit's redo drops a result
    assert lost not in ctx.blobs.step_keys(job_id)
    upload_all(ctx, job_id, 0, shards=[1])
    assert lost in ctx.blobs.step_keys(job_id)
    assert run_apply_step(ctx, job_id, 0) == "applied"
    assert ctx.blobs.step_keys(job_id, 0, 1) == [] and not ctx.blobs.exists(lost)


def test_an_entry_without_its_key_or_a_key_without_its_entry_stalls_no_step(
        ctx: SchedulerContext) -> None:
    """Both halves of a write cut between key and entry (which the store's transaction rules
    out): the step applies; the stale entry goes with the step's drop; the unindexed key (left
    by the drop, which never lists the keyspace) goes when the job is released."""
    job_id = start_job(ctx)
    expired = keys.upload_body(job_id, 0, "expired")
    ctx.blobs.set(expired, b"x", ttl=0.01)
    unindexed = keys.upload_body(job_id, 0, "unindexed")
    write_unindexed(ctx.blobs, unindexed)
    time.sleep(0.05)
    assert expired in ctx.blobs.step_keys(job_id) and not ctx.blobs.exists(expired)
    assert unindexed not in ctx.blobs.step_keys(job_id)

    run_to(ctx, job_id, 2)
    assert ctx.blobs.step_keys(job_id, 0, 2) == []
    assert ctx.blobs.exists(unindexed)
    with transaction(ctx.session_factory) as s:
        row = s.get(Job, job_id)
        assert row is not None
        row.state = "Cancelled"
    assert run_reconcile_job(ctx, job_id).startswith("released:")
    assert ctx.blobs.keys(keys.job_prefix(job_id)) == [] and index_gone(ctx.blobs, job_id)


def test_a_job_that_succeeds_leaves_no_key_not_even_one_its_index_never_named(
        ctx: SchedulerContext) -> None:
    """Its final commit releases its assignments, so no reconcile pass comes back for it: the
    final step's publish drops the whole job (the state it ended at, and keys written before
    the index or whose index Redis evicted), while another job's keys stay."""
    job_id = start_job(ctx)
    other = "job-other"
    ctx.blobs.set(keys.grad(other, 0, 0), b"another job's result")
    unindexed = keys.upload_body(job_id, 0, "from-before-the-index")
    write_unindexed(ctx.blobs, unindexed)
    run_to(ctx, job_id, 1)
    assert ctx.blobs.exists(unindexed)  # a routine drop never lists the keyspace
    with ctx.session_factory() as s:
        total = s.get(Job, job_id).total_steps  # type: ignore[union-attr]
    run_to(ctx, job_id, total)
    with ctx.session_factory() as s:
        assert s.get(Job, job_id).state == "Succeeded"  # type: ignore[union-attr]
    assert ctx.blobs.keys(keys.job_prefix(job_id)) == [] and index_gone(ctx.blobs, job_id)
    assert ctx.blobs.keys(keys.job_prefix(other)) and ctx.blobs.step_keys(other)


def test_a_rewind_drops_every_other_steps_keys_and_a_routine_drop_only_earlier_ones(
        ctx: SchedulerContext) -> None:
    job_id = start_job(ctx)
    for t in (1, 2, 3, 4):
        ctx.blobs.set(keys.grad(job_id, t, 0), b"r")
    drop_step_keys(ctx, job_id, keep_state=2)
    assert {keys.step_of_key(k) for k in ctx.blobs.step_keys(job_id)} == {2, 3, 4}
    drop_step_keys(ctx, job_id, keep_state=3, rewound=True)
    assert ctx.blobs.step_keys(job_id) == [keys.grad(job_id, 3, 0)]
