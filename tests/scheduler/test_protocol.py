"""The step protocol through the real app (create_app + the control plane's auth): first upload
wins, stale steps are 409, foreign shards 403, malformed bodies 422, long polls wake."""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from api.steps.protocol import ForeignShard, StateMissing
from domain.settings import Settings
from engine.data import load_dataset
from engine.jobinfo import job_info
from engine.sampler import shard_indices
from engine.step import ShardResult, pre_reduce, reduce_results
from hotstate import keys
from roots.api import create_app
from scheduler import context
from scheduler.tasks.reconcile import run_reconcile, run_reconcile_job
from scheduler.tasks.steps import run_apply_step
from tests.scheduler.helpers import (
    admin,
    enroll,
    job,
    running_job,
    shard_result_blobs,
    shards_of,
    tiny_spec,
)
from tests.support.env import ADMIN_TOKEN as ADMIN
from wire.messages import decode_results, decode_weights, encode_results, join_weights


@pytest.fixture
def app_client(sqlite_url: str, tmp_path: Path) -> Iterator[TestClient]:
    settings = Settings(database_url=sqlite_url, data_dir=tmp_path / "data", admin_token=ADMIN)
    app = create_app(settings)
    with TestClient(app) as client:
        yield client
    context.reset()


def test_an_assignment_from_the_fast_path_is_the_routes(app_client: TestClient) -> None:
    """The work long poll is answered ahead of FastAPI (api.fast_path); with shards to do, its
    answer is byte for byte what the FastAPI route answers."""
    from fastapi import FastAPI

    app = app_client.app
    stack = FastAPI.build_middleware_stack(app)  # the app without the fast path in front

    async def routes_only(scope: dict, receive: Any, send: Any) -> None:
        scope["app"] = app
        await stack(scope, receive, send)

    job_id, [(dev, hdr), _] = running_job(app_client)
    fast = app_client.get(f"/v1/devices/{dev}/work", params={"wait": 0}, headers=hdr)
    routed = TestClient(routes_only).get(f"/v1/devices/{dev}/work", params={"wait": 0},
                                         headers=hdr)
    assert fast.status_code == routed.status_code == 200
    assert fast.json()["assignment"]["shards"] == shards_of(job_id, dev)
    assert fast.content == routed.content
    assert fast.headers["content-type"] == routed.headers["content-type"]


def test_work_weights_and_data_for_the_devices_own_shards(app_client: TestClient) -> None:
    job_id, [(dev, hdr), (other, _)] = running_job(app_client)
    work = app_client.get(f"/v1/devices/{dev}/work", params={"wait": 0}, headers=hdr).json()
    a = work["assignment"]
    assert a["job_id"] == job_id and a["step"] == 0 and a["shards"] == shards_of(job_id, dev)
    assert a["n_train"] == 64 and a["input_shape"] == [1, 4, 4] and a["num_classes"] == 3
    w = app_client.get(f"/v1/jobs/{job_id}/weights", params={"step": 0}, headers=hdr)
    assert w.status_code == 200
    step, params, _ = decode_weights(w.content, expect_job=job_id)
    assert step == 0 and params.size == a["n_params"]
    assert app_client.get(f"/v1/jobs/{job_id}/weights", params={"step": 3},
                          headers=hdr).status_code == 409
    mine, theirs = shards_of(job_id, dev)[0], shards_of(job_id, other)[0]
    data = app_client.get(f"/v1/jobs/{job_id}/shards/{mine}/data", headers=hdr)
    assert data.status_code == 200
    # the shard's samples in its seeded order, as the engine's sampler and dataset give them
    spec = tiny_spec()
    dataset = load_dataset(spec["dataset"], None)
    order = shard_indices(len(dataset.y_train), spec["shards"], spec["seed"])[mine]
    with np.load(io.BytesIO(data.content), allow_pickle=False) as arrays:
        assert arrays["x"].dtype == np.float32 and arrays["y"].dtype == np.int64
        np.testing.assert_array_equal(arrays["x"], dataset.x_train[order])
        np.testing.assert_array_equal(arrays["y"], dataset.y_train[order])
    assert app_client.get(f"/v1/jobs/{job_id}/shards/{theirs}/data", headers=hdr).status_code == 403
    assert app_client.get(f"/v1/devices/{other}/work", headers=hdr).status_code == 403


def test_duplicate_uploads_change_nothing_and_first_upload_wins(app_client: TestClient) -> None:
    job_id, [(dev, hdr), (other, other_hdr)] = running_job(app_client)
    ctx = context.get_context()
    blobs = shard_result_blobs(ctx, job_id, 0)
    mine = shards_of(job_id, dev)
    url = f"/v1/jobs/{job_id}/steps/0/gradients"
    first = app_client.post(url, content=blobs[mine[0]], headers=hdr)
    assert first.json() == {"accepted": [mine[0]], "duplicates": []}
    again = app_client.post(url, content=blobs[mine[0]], headers=hdr)
    assert again.status_code == 200 and again.json() == {"accepted": [], "duplicates": [mine[0]]}
    sent = decode_results(blobs[mine[0]])[0]
    kept = stored_result(ctx, job_id, 0, mine[0])
    assert kept.shard == sent.shard and kept.grad_sum.tobytes() == sent.grad_sum.tobytes()
    assert len(ctx.blobs.keys(f"job:{job_id}:body:0:")) == 1  # the duplicate's body is not kept
    theirs = shards_of(job_id, other)[0]
    assert app_client.post(url, content=blobs[theirs], headers=hdr).status_code == 403
    assert app_client.post(url, content=b"garbage", headers=hdr).status_code == 422
    for device, headers in ((dev, hdr), (other, other_hdr)):
        for k in shards_of(job_id, device):
            app_client.post(url, content=blobs[k], headers=headers)
    assert run_apply_step(ctx, job_id, 0) == "applied"
    assert run_apply_step(ctx, job_id, 0) == "stale"
    late = app_client.post(url, content=blobs[mine[0]], headers=hdr)
    assert late.status_code == 409 and "step 1" in late.json()["detail"]
    assert job(ctx, job_id).step == 1


def test_a_multi_shard_upload_is_stored_per_shard(app_client: TestClient) -> None:
    job_id, [(dev, hdr), _] = running_job(app_client)
    ctx = context.get_context()
    blobs = shard_result_blobs(ctx, job_id, 0)
    mine = shards_of(job_id, dev)
    results = [decode_results(blobs[k])[0] for k in mine]
    r = app_client.post(f"/v1/jobs/{job_id}/steps/0/gradients",
                        content=encode_results(job_id, 0, results), headers=hdr)
    assert r.json()["accepted"] == mine
    for k, r in zip(mine, results):
        stored = stored_result(ctx, job_id, 0, k)
        assert stored.shard == k and np.array_equal(stored.grad_sum, r.grad_sum)
        assert np.array_equal(stored.stats, r.stats) and stored.loss_sum == r.loss_sum
    # one message, stored once: every shard's key points into it
    assert len(ctx.blobs.keys(f"job:{job_id}:body:0:")) == 1


def stored_result(ctx: Any, job_id: str, step: int, shard: int) -> Any:
    from hotstate.gradstore import body_key_of, unpack

    info = job_info(job_id, job(ctx, job_id).spec, ctx.settings.data_dir)
    data = ctx.blobs.get(keys.grad(job_id, step, shard))
    ref = body_key_of(data)
    return unpack(data, info.model.n_params, info.model.n_stats,
                  ctx.blobs.get(ref) if ref else None)


def test_a_partial_of_a_devices_shards_is_stored_once_and_the_step_applies(
        app_client: TestClient) -> None:
    """Issue 21 item 1 on the wire: the assignment says partials are welcome; a phone's two
    shards go up as one partial under one key; a range that is no node of the tree, a partial
    whose sample count is wrong, or one reaching into another phone's shards is refused."""
    job_id, phones = running_job(app_client)
    ctx = context.get_context()
    # (dev, hdr) holds shards 0 and 1: which phone that is depends on the devices' ids
    [(dev, hdr), (other, other_hdr)] = sorted(phones, key=lambda p: shards_of(job_id, p[0]))
    work = app_client.get(f"/v1/devices/{dev}/work", params={"wait": 0}, headers=hdr).json()
    assert work["assignment"]["pre_reduce"] is True
    leaves = {k: decode_results(b)[0] for k, b in shard_result_blobs(ctx, job_id, 0).items()}
    mine, theirs = shards_of(job_id, dev), shards_of(job_id, other)
    assert mine == [0, 1] and theirs == [2, 3]
    url = f"/v1/jobs/{job_id}/steps/0/gradients"

    def post(results: list[ShardResult], headers: dict = hdr) -> Any:
        return app_client.post(url, content=encode_results(job_id, 0, results), headers=headers)

    not_a_node = reduce_results([leaves[1], leaves[2]], 1, 3, "float32")
    refused = post([not_a_node])
    assert refused.status_code == 422 and "1..2 are not a node" in refused.json()["detail"]
    everything = reduce_results(list(leaves.values()), 0, 4, "float32")
    assert post([everything]).status_code == 403  # shards 2 and 3 are the other phone's
    [partial] = pre_reduce([leaves[k] for k in mine], 4, "float32")
    short = post([replace(partial, count=partial.count - 1)])
    assert short.status_code == 422 and "samples" in short.json()["detail"]
    assert ctx.blobs.keys(keys.grad_prefix(job_id, 0)) == []  # nothing refused was stored
    accepted = post([partial])
    assert accepted.json() == {"accepted": [0, 1], "duplicates": []}
    assert ctx.blobs.keys(keys.grad_prefix(job_id, 0)) == [keys.grad(job_id, 0, 0, 2)]
    assert post([partial]).json() == {"accepted": [], "duplicates": [0, 1]}
    assert app_client.get(f"/v1/devices/{dev}/work", params={"wait": 0},
                          headers=hdr).json()["assignment"] is None  # nothing left to do
    assert post([leaves[2], leaves[3]], other_hdr).json()["accepted"] == [2, 3]
    assert run_apply_step(ctx, job_id, 0) == "applied"
    assert job(ctx, job_id).step == 1


def test_a_float16_job_takes_each_shards_result_and_no_partial(app_client: TestClient) -> None:
    """Sums of gradients leave float16's range (65504): a float16 job's assignment asks for no
    partials, a partial is refused naming why, and each shard's own result is taken."""
    job_id, phones = running_job(app_client, upload_precision="float16")
    [(dev, hdr), _] = sorted(phones, key=lambda p: shards_of(job_id, p[0]))
    work = app_client.get(f"/v1/devices/{dev}/work", params={"wait": 0}, headers=hdr).json()
    assert work["assignment"]["pre_reduce"] is False
    ctx = context.get_context()
    leaves = {k: decode_results(b)[0] for k, b in shard_result_blobs(ctx, job_id, 0).items()}
    url = f"/v1/jobs/{job_id}/steps/0/gradients"
    # a partial as an agent ignoring the assignment would add it (float32 nodes)
    partial = reduce_results([leaves[0], leaves[1]], 0, 2, "float16")
    refused = app_client.post(url, content=encode_results(job_id, 0, [partial], "float16"),
                              headers=hdr)
    assert refused.status_code == 422 and "float16" in refused.json()["detail"]
    assert pre_reduce([leaves[0], leaves[1]], 4, "float16") == [leaves[0], leaves[1]]
    both = app_client.post(url, content=encode_results(job_id, 0, [leaves[0], leaves[1]],
                                                       "float16"), headers=hdr)
    assert both.json() == {"accepted": [0, 1], "duplicates": []}


def test_a_diverged_shard_fails_the_job_with_its_reason(app_client: TestClient) -> None:
    """Every device computes a shard's bits alike, so a result that is not finite would be so
    anywhere: the device's report fails the job, naming the step and what was seen, instead of
    the shard moving from phone to phone for ever. Only a holder of the shard, at the job's
    current step, may say so."""
    job_id, phones = running_job(app_client)
    [(dev, hdr), (other, other_hdr)] = sorted(phones, key=lambda p: shards_of(job_id, p[0]))
    url = f"/v1/jobs/{job_id}/steps/0/diverged"
    seen = {"shard": 1, "reason": "shard 1: gradient is not finite in float32"}
    foreign = app_client.post(url, json=seen, headers=other_hdr)
    assert foreign.status_code == 403 and "shard 1" in foreign.json()["detail"]
    stale = app_client.post(f"/v1/jobs/{job_id}/steps/3/diverged", json=seen, headers=hdr)
    assert stale.status_code == 409
    bad = app_client.post(url, json={"shard": 1, "reason": ""}, headers=hdr)
    assert bad.status_code == 422
    assert app_client.get(f"/v1/jobs/{job_id}", headers=admin(app_client)).json()["state"] == \
        "Running"
    reported = app_client.post(url, json=seen, headers=hdr)
    assert reported.status_code == 200 and reported.json() == {"failed": True}
    failed = app_client.get(f"/v1/jobs/{job_id}", headers=admin(app_client)).json()
    assert failed["state"] == "Failed"
    assert failed["reason"].startswith("diverged at step 0: shard 1: gradient is not finite")
    events = app_client.get(f"/v1/jobs/{job_id}/events", headers=admin(app_client)).json()
    assert "Diverged" in [e["reason"] for e in events["items"]]
    again = app_client.post(url, json=seen, headers=hdr)
    # docs/api.md: "409 another step or the job not running" (its shards are released too)
    assert again.status_code == 409, again.text
    assert app_client.get(f"/v1/devices/{dev}/work", params={"wait": 0},
                          headers=hdr).json()["assignment"] is None


def test_the_long_poll_wakes_when_work_arrives(app_client: TestClient) -> None:
    dev, hdr = enroll(app_client, "lonely")
    got: dict = {}

    def poll() -> None:
        started = time.monotonic()
        got["reply"] = app_client.get(f"/v1/devices/{dev}/work", params={"wait": 20},
                                      headers=hdr).json()
        got["seconds"] = time.monotonic() - started

    thread = threading.Thread(target=poll)
    thread.start()
    time.sleep(0.3)
    r = app_client.post("/v1/jobs", json=tiny_spec(), headers=admin(app_client))
    ctx = context.get_context()
    run_reconcile(ctx)
    run_reconcile_job(ctx, r.json()["id"])
    thread.join(30)
    assert got["reply"]["assignment"]["job_id"] == r.json()["id"]
    assert got["seconds"] < 15  # woke on the change, not at the end of the wait


def test_a_device_with_nothing_to_do_gets_null_after_the_wait(app_client: TestClient) -> None:
    dev, hdr = enroll(app_client, "idle")
    r = app_client.get(f"/v1/devices/{dev}/work", params={"wait": 0.2}, headers=hdr)
    assert r.status_code == 200 and r.json() == {"assignment": None}


@pytest.mark.parametrize("store", ["memory", "redis"])
def test_weights_are_the_message_apply_step_made_or_encoded_from_the_stored_state(
        app_client: TestClient, store: str, request: pytest.FixtureRequest) -> None:
    """The process that applied a step serves the message it made; any other process (another
    replica, or after a restore from a checkpoint) encodes the same bytes from the state's
    params and buffers in the blob store."""
    from api.steps.protocol import StepProtocol
    from hotstate.blobs import RedisBlobStore
    from hotstate.recent import RECENT
    from hotstate.trainstate import decode_state
    from tests.scheduler.helpers import state_key, upload_all
    from wire.messages import encode_weights

    job_id, [(dev, hdr), _] = running_job(app_client)
    ctx = context.get_context()
    upload_all(ctx, job_id, 0)
    assert run_apply_step(ctx, job_id, 0) == "applied"
    nonce = job(ctx, job_id).state_nonce
    made = bytes(RECENT.weights(job_id, 1, nonce))
    state = decode_state(ctx.blobs.get(state_key(ctx, job_id, 1)), expect_step=1)
    assert made == encode_weights(job_id, 1, state.params, state.buffers)
    served = app_client.get(f"/v1/jobs/{job_id}/weights", params={"step": 1}, headers=hdr)
    assert served.status_code == 200 and served.content == made
    blobs = ctx.blobs
    if store == "redis":  # the state as another replica finds it in Redis
        blobs = RedisBlobStore(request.getfixturevalue("redis_url"))
        blobs.set(state_key(ctx, job_id, 1), ctx.blobs.get(state_key(ctx, job_id, 1)))
    RECENT.remember(job_id, state, nonce)  # as if another process had applied it: no message
    other = StepProtocol(ctx.session_factory, blobs, ctx.settings.data_dir, ctx.clock)
    assert bytes(other.weights(dev, job_id, 1)[0]) == made
    blobs.delete(state_key(ctx, job_id, 1))  # gone (Redis restarted): 503, retry shortly
    with pytest.raises(StateMissing):
        StepProtocol(ctx.session_factory, blobs, ctx.settings.data_dir, ctx.clock).weights(
            dev, job_id, 1)


def test_concurrent_first_weight_requests_encode_once(app_client: TestClient,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from api.steps import protocol
    from api.steps.protocol import StepProtocol

    job_id, [(dev, _), _] = running_job(app_client)
    ctx = context.get_context()
    calls = []
    real = protocol.encode_weights

    def slow_encode(*args, **kwargs):
        calls.append(1)
        time.sleep(0.05)  # widen the window in which the other requests arrive
        return real(*args, **kwargs)

    monkeypatch.setattr(protocol, "encode_weights", slow_encode)
    fresh = StepProtocol(ctx.session_factory, ctx.blobs, ctx.settings.data_dir, ctx.clock)
    with ThreadPoolExecutor(6) as pool:
        bodies = list(pool.map(lambda _: fresh.weights(dev, job_id, 0)[0], range(6)))
    assert len(set(bodies)) == 1 and len(calls) == 1


def test_a_step_reads_the_store_once_per_device_and_sees_changes_after_a_bump(
        app_client: TestClient) -> None:
    """work, weights and shard data of one step cost no query after the first request; a
    committed change announced by the version key is seen at the next request, read once
    for all devices."""
    from sqlalchemy import event, update

    from api.steps.protocol import StepProtocol
    from domain.store.models import ShardAssignment
    from hotstate.version import bump_version

    job_id, [(dev, _), (other, _)] = running_job(app_client)
    ctx = context.get_context()
    proto = StepProtocol(ctx.session_factory, ctx.blobs, ctx.settings.data_dir, ctx.clock)
    engine = ctx.session_factory.kw["bind"]
    statements: list[str] = []

    def count(conn, cursor, statement, *args) -> None:
        statements.append(statement)

    event.listen(engine, "before_cursor_execute", count)
    try:
        mine = proto.work(dev).shards
        assert statements, "the first request reads the device's holdings"
        statements.clear()
        assert proto.work(dev).shards == mine
        proto.weights(dev, job_id, 0)
        proto.shard_data(dev, job_id, mine[0])
        assert statements == []
        # one of the other device's shards moves here; the change is announced by a bump
        theirs = shards_of(job_id, other)[0]
        with ctx.session_factory.begin() as s:
            s.execute(update(ShardAssignment).where(ShardAssignment.job_id == job_id,
                                                    ShardAssignment.shard == theirs)
                      .values(device_id=dev))
        bump_version(ctx.blobs)
        assert proto.work(dev).shards == sorted([*mine, theirs])
        assert statements, "a new version re-reads the holdings"
        # ... once for every device: the other agent woken by the same bump reads nothing
        statements.clear()
        assert theirs not in proto.work(other).shards
        assert statements == []
    finally:
        event.remove(engine, "before_cursor_execute", count)
    with pytest.raises(ForeignShard):
        proto.shard_data(other, job_id, theirs)


def test_a_device_that_holds_no_shard_of_a_job_gets_no_weights_and_no_data(
        app_client: TestClient) -> None:
    job_id, [(dev, hdr), _] = running_job(app_client)
    outsider, outsider_hdr = enroll(app_client, "joined-late")  # after placement: holds nothing
    assert shards_of(job_id, outsider) == []
    for headers, status in ((hdr, 200), (outsider_hdr, 403)):
        r = app_client.get(f"/v1/jobs/{job_id}/weights", params={"step": 0}, headers=headers)
        assert r.status_code == status, r.text
    assert r.json() == {"detail": f"device {outsider} holds no shard of {job_id}"}
    mine = shards_of(job_id, dev)[0]
    r = app_client.get(f"/v1/jobs/{job_id}/shards/{mine}/data", headers=outsider_hdr)
    assert r.status_code == 403


def test_weights_lost_with_the_hot_state_are_503_retry_after_until_restored(
        app_client: TestClient) -> None:
    job_id, [(dev, hdr), _] = running_job(app_client)
    ctx = context.get_context()
    ctx.blobs.flush()  # Redis restarted empty
    r = app_client.get(f"/v1/jobs/{job_id}/weights", params={"step": 0}, headers=hdr)
    assert r.status_code == 503 and r.headers["Retry-After"] == "1", r.text
    assert "being restored" in r.json()["detail"]
    assert run_reconcile_job(ctx, job_id) in ("restored", "ok")
    r = app_client.get(f"/v1/jobs/{job_id}/weights", params={"step": 0}, headers=hdr)
    assert r.status_code == 200
    step, params, _ = decode_weights(r.content, expect_job=job_id)
    assert step == 0 and params.size > 0


def test_a_phone_gets_an_uploaded_shard_in_chunks_as_stored_and_reads_the_same_samples(
        app_client: TestClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An upload of uint8 images with mean and std: the server reads the shard from disk a
    chunk at a time and sends it as stored (a quarter of float32's bytes); the phone's cache
    joins the chunks into one file, and the engine reads from it exactly the float32 samples
    the whole-shard answer of an older agent holds."""
    from agent.runtime.cache import WorkCache
    from api.steps import protocol
    from engine.runner import shard_arrays

    rng = np.random.default_rng(4)
    buf = io.BytesIO()
    np.savez(buf, x=rng.integers(0, 256, (200, 3, 4, 4), dtype=np.uint8),
             y=np.arange(200) % 3, mean=np.array([0.4, 0.5, 0.6]), std=np.array([0.2, 0.3, 0.4]))
    up = app_client.post("/v1/datasets", data={"name": "imgs"}, headers=admin(app_client),
                         files={"file": ("imgs.npz", buf.getvalue(), "application/octet-stream")})
    assert up.status_code == 201, up.text
    job_id, [(dev, hdr), _] = running_job(app_client, dataset="imgs")
    mine = shards_of(job_id, dev)[0]
    url = f"/v1/jobs/{job_id}/shards/{mine}/data"
    whole = app_client.get(url, headers=hdr)  # an agent before chunks: float32, normalized
    monkeypatch.setattr(protocol, "SHARD_CHUNK_BYTES", 5 * 3 * 4 * 4 * 4)  # 5 samples a chunk
    asked: list[int] = []

    def fetch(start: int) -> tuple[bytes, int | None]:
        asked.append(start)
        r = app_client.get(url, params={"start": start, "encoding": "raw"}, headers=hdr)
        assert r.status_code == 200, r.text
        return r.content, int(r.headers["x-phalanx-shard-samples"])

    path = WorkCache(tmp_path / "phone").shard(job_id, mine, fetch)
    with np.load(io.BytesIO(whole.content)) as arrays:
        n = len(arrays["y"])
        assert arrays["x"].dtype == np.float32
        xs, ys = shard_arrays(str(path))
        np.testing.assert_array_equal(xs, arrays["x"])
        np.testing.assert_array_equal(ys, arrays["y"])
    assert asked == list(range(0, n, 5)) and n > 5
    with np.load(path) as stored:
        assert stored["x"].dtype == np.uint8


def test_a_sliced_jobs_weights_come_a_slice_at_a_time_naming_their_state(
        app_client: TestClient) -> None:
    job_id, [(dev, hdr), _] = running_job(app_client, slices=3)
    a = app_client.get(f"/v1/devices/{dev}/work", params={"wait": 0}, headers=hdr).json()[
        "assignment"]
    assert len(a["slices"]) == 3 and a["state"]
    url = f"/v1/jobs/{job_id}/weights"
    parts = [app_client.get(url, params={"step": 0, "slice": k}, headers=hdr) for k in range(3)]
    assert all(p.status_code == 200 and p.headers["x-phalanx-state"] == a["state"]
               for p in parts)
    whole = app_client.get(url, params={"step": 0}, headers=hdr)
    assert b"".join(join_weights(job_id, 0, [p.content for p in parts])) == whole.content
    missing = app_client.get(url, params={"step": 0, "slice": 3}, headers=hdr)
    assert missing.status_code == 422 and "has 3 slices" in missing.text
    # the next step's slice before it is applied: 409 at once, or after `wait`
    early = app_client.get(url, params={"step": 1, "slice": 0, "wait": 0.2}, headers=hdr)
    assert early.status_code == 409 and "not applied yet" in early.text


def test_a_job_without_slices_refuses_a_slice(app_client: TestClient) -> None:
    job_id, [(dev, hdr), _] = running_job(app_client)
    r = app_client.get(f"/v1/jobs/{job_id}/weights", params={"step": 0, "slice": 0}, headers=hdr)
    assert r.status_code == 422 and "not sliced" in r.text


def test_only_an_upload_that_may_complete_its_step_asks_which_results_are_stored(
        app_client: TestClient) -> None:
    """Asking which of a step's results are stored costs O(shards) keys, and every upload
    would ask: each counts the shards it stored instead, and only the one whose count reaches
    the job's shards asks (or one that finds a result stored already: a retry's). A result
    lost after it was counted
    (its body gone) leaves the count too high, so the next uploads ask, and the step still
    completes only when every shard is stored."""
    from api.steps.protocol import StepProtocol

    job_id, phones = running_job(app_client)
    ctx = context.get_context()
    proto = StepProtocol(ctx.session_factory, ctx.blobs, ctx.settings.data_dir, ctx.clock)
    blobs = shard_result_blobs(ctx, job_id, 0)
    [(dev, _), (other, _)] = sorted(phones, key=lambda p: shards_of(job_id, p[0]))
    asked: list[int] = []
    which_exist = ctx.blobs.which_exist
    ctx.blobs.which_exist = lambda names: asked.append(len(names)) or which_exist(names)
    try:
        def upload(device: str, shard: int) -> tuple[bool, int]:
            asked.clear()
            done = proto.upload(device, job_id, 0, blobs[shard]).complete
            return done, len(asked)

        assert upload(dev, 0) == (False, 0)
        assert upload(dev, 1) == (False, 0)
        assert upload(dev, 1) == (False, 1)  # a duplicate (a retry?): asked, to be sure
        assert upload(other, 2) == (False, 0)
        ctx.blobs.delete(keys.grad(job_id, 0, 1))  # lost after it was counted
        assert upload(other, 3) == (False, 1)  # the count says 4 of 4: asked, and shard 1 is not
        assert upload(dev, 1) == (True, 1)
        assert len(asked) == 1 and asked[0] == 2 * 4 - 1  # the tree over 4 shards: 7 keys
    finally:
        ctx.blobs.which_exist = which_exist


def test_an_upload_that_fails_after_storing_some_results_still_lets_its_step_complete(
        app_client: TestClient) -> None:
    """A write that fails partway (Redis timing out, the replica dying) leaves some results
    stored: they are counted all the same, and the agent's retry, which finds them stored
    already, completes the step when it is the last upload; no wait for reconcile."""
    from api.steps.protocol import StepProtocol

    job_id, phones = running_job(app_client)
    ctx = context.get_context()
    proto = StepProtocol(ctx.session_factory, ctx.blobs, ctx.settings.data_dir, ctx.clock)
    [(dev, _), (other, _)] = sorted(phones, key=lambda p: shards_of(job_id, p[0]))
    leaves = {k: decode_results(b)[0] for k, b in shard_result_blobs(ctx, job_id, 0).items()}
    mine = encode_results(job_id, 0, [leaves[0], leaves[1]])
    set_if_absent, writes = ctx.blobs.set_if_absent, []

    def fail_second(key: str, value: bytes, ttl: float | None = None) -> bool:
        writes.append(key)
        if len(writes) == 2:
            raise ConnectionError("Redis went away")
        return set_if_absent(key, value, ttl)

    ctx.blobs.set_if_absent = fail_second
    try:
        with pytest.raises(ConnectionError):
            proto.upload(dev, job_id, 0, mine)
    finally:
        ctx.blobs.set_if_absent = set_if_absent
    assert ctx.blobs.get(keys.covered(job_id, 0)) == b"1"  # shard 0 stored and counted
    theirs = proto.upload(other, job_id, 0, encode_results(job_id, 0, [leaves[2], leaves[3]]))
    assert theirs.accepted == [2, 3] and not theirs.complete
    retry = proto.upload(dev, job_id, 0, mine)
    assert (retry.accepted, retry.duplicates, retry.complete) == ([1], [0], True)

    # stored, then the count lost with the replica (or its Redis connection) before it was
    # made: the retry finds every result stored already, asks, and sends the step's apply
    job_id, phones = running_job(app_client)
    [(dev, _), (other, _)] = sorted(phones, key=lambda p: shards_of(job_id, p[0]))
    leaves = {k: decode_results(b)[0] for k, b in shard_result_blobs(ctx, job_id, 0).items()}
    mine = encode_results(job_id, 0, [leaves[0], leaves[1]])
    incr = ctx.blobs.incr
    ctx.blobs.incr = lambda key, amount: (_ for _ in ()).throw(ConnectionError("gone"))
    try:
        with pytest.raises(ConnectionError):
            proto.upload(dev, job_id, 0, mine)
    finally:
        ctx.blobs.incr = incr
    assert not proto.upload(other, job_id, 0,
                            encode_results(job_id, 0, [leaves[2], leaves[3]])).complete
    retry = proto.upload(dev, job_id, 0, mine)
    assert (retry.accepted, retry.duplicates, retry.complete) == ([], [0, 1], True)
