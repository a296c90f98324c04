"""Every uploaded dataset has an owner (issue 42, item 5): another user's private dataset is
answered as none (404) to list, read, use (a job or a dry run naming it) and delete; the
built-ins are everybody's; sharing is an admin's act; a user's datasets fit a byte quota."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from domain.store.models import Dataset, Job
from tests.support.arrays import npz_bytes
from tests.support.env import ADMIN_TOKEN as ADMIN


def _npz(n: int = 40, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    return npz_bytes(x=rng.random((n, 1, 4, 4), dtype=np.float32), y=np.arange(n) % 3)


def _upload(api, name: str, data: bytes, token: str):
    return api.post("/v1/datasets", token=token, data={"name": name},
                    files={"file": (f"{name}.npz", data, "application/octet-stream")})


def _resumable(api, name: str, data: bytes, token: str):
    opened = api.post("/v1/datasets/uploads", token=token, json={
        "name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    if opened.status_code != 201:
        return opened
    upload_id = opened.json()["id"]
    sent = api.client.put(f"/v1/datasets/uploads/{upload_id}", params={"offset": 0},
                          content=data, headers={**api.headers(token),
                                                 "Content-Type": "application/octet-stream"})
    assert sent.status_code == 200, sent.text
    return api.post(f"/v1/datasets/uploads/{upload_id}/complete", token=token)


def _job(dataset: str) -> dict:
    return {"name": "t", "model": {"arch": "logreg"}, "dataset": dataset,
            "global_batch_size": 8, "shards": 4, "epochs": 1}


def _names(api, token: str) -> list[str]:
    resp = api.get("/v1/datasets", token=token)
    assert resp.status_code == 200, resp.text
    return [d["name"] for d in resp.json()["items"]]


def test_another_users_dataset_is_none_to_list_read_use_and_delete(api):
    alice, bob = api.user_token("alice"), api.user_token("bob")
    assert _upload(api, "alices", _npz(), alice).status_code == 201
    assert _resumable(api, "alices-big", _npz(60, seed=1), alice).status_code == 201

    assert _names(api, alice) == ["digits", "alices", "alices-big"]
    assert _names(api, bob) == ["digits"]
    assert _names(api, ADMIN) == [
        "digits", "alices", "alices-big"]  # an admin sees every dataset

    mine = api.get("/v1/datasets/alices", token=alice)
    assert mine.status_code == 200 and mine.json()["owner"] is not None
    assert mine.json()["public"] is False and mine.json()["stored_bytes"] > 0

    nothing = api.get("/v1/datasets/no-such", token=bob)
    assert nothing.status_code == 404
    for name in ("alices", "alices-big"):
        for answer in (api.get(f"/v1/datasets/{name}", token=bob),
                       api.post("/v1/jobs", token=bob, json=_job(name)),
                       api.post("/v1/jobs?dry_run=true", token=bob, json=_job(name)),
                       api.delete(f"/v1/datasets/{name}", token=bob)):
            assert answer.status_code == 404, answer.text
            # word for word what a dataset that does not exist answers
            assert answer.json()["detail"] == f"dataset {name!r} not found"
        assert "sha256" not in api.get(f"/v1/datasets/{name}", token=bob).text
    assert api.post("/v1/jobs", token=bob, json=_job("no-such")).json() == {
        "detail": "dataset 'no-such' not found"}
    assert api.count(Job) == 0 and api.count(Dataset) == 2

    # the built-ins are everybody's
    assert api.get("/v1/datasets/digits", token=bob).json()["builtin"] is True
    assert api.post("/v1/jobs?dry_run=true", token=bob, json=_job("digits")).status_code == 200
    synthetic = _job("synthetic:1x4x4:3:64")
    assert api.post("/v1/jobs?dry_run=true", token=bob, json=synthetic).status_code == 200
    # and the owner (and an admin) use theirs
    assert api.post("/v1/jobs?dry_run=true", token=alice, json=_job("alices")).status_code == 200
    assert api.post("/v1/jobs?dry_run=true", json=_job("alices")).status_code == 200


def test_sharing_is_an_admins_act(api):
    alice, bob = api.user_token("alice"), api.user_token("bob")
    assert _upload(api, "shared", _npz(), alice).status_code == 201
    for token in (alice, bob):  # not even the owner shares: it is the admin's decision
        refused = api.client.patch("/v1/datasets/shared", json={"public": True},
                                   headers=api.headers(token))
        assert refused.status_code == 403, refused.text
    assert api.client.patch("/v1/datasets/no-such", json={"public": True},
                            headers=api.headers()).status_code == 404
    shared = api.client.patch("/v1/datasets/shared", json={"public": True},
                              headers=api.headers())
    assert shared.status_code == 200 and shared.json()["public"] is True

    assert _names(api, bob) == ["digits", "shared"]
    seen = api.get("/v1/datasets/shared", token=bob).json()
    assert seen["public"] is True and seen["owner"] is None  # not whose it is
    assert api.get("/v1/datasets/shared", token=alice).json()["owner"] is not None
    job = api.post("/v1/jobs", token=bob, json=_job("shared"))
    assert job.status_code == 201, job.text
    # seen, not owned: bob may not remove it
    removed = api.delete("/v1/datasets/shared", token=bob)
    assert removed.status_code == 403 and "not yours" in removed.text

    unshared = api.client.patch("/v1/datasets/shared", json={"public": False},
                                headers=api.headers())
    assert unshared.status_code == 200
    assert _names(api, bob) == ["digits"]
    assert api.post("/v1/jobs?dry_run=true", token=bob,
                    json=_job("shared")).status_code == 404


def test_the_owner_removes_a_dataset_and_its_files(api):
    alice = api.user_token("alice")
    assert _upload(api, "gone", _npz(), alice).status_code == 201
    folder = api.settings.data_dir / "datasets" / "gone"
    assert folder.is_dir()
    job = api.post("/v1/jobs", token=alice, json=_job("gone"))
    assert job.status_code == 201
    busy = api.delete("/v1/datasets/gone", token=alice)
    assert busy.status_code == 409 and "unfinished job" in busy.text
    assert api.post(f"/v1/jobs/{job.json()['id']}/cancel", token=alice).status_code == 200

    removed = api.delete("/v1/datasets/gone", token=alice)
    assert removed.status_code == 200 and removed.json()["name"] == "gone"
    assert not folder.exists() and api.count(Dataset) == 0
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".")]
    assert api.get("/v1/datasets/gone", token=alice).status_code == 404
    assert api.delete("/v1/datasets/gone", token=alice).status_code == 404
    # the name is free again
    assert _upload(api, "gone", _npz(50), alice).status_code == 201
    assert api.get("/v1/datasets/gone", token=alice).json()["n_train"] == 40
    assert api.delete("/v1/datasets/digits", token=alice).status_code == 403
    # an admin removes anyone's
    assert api.delete("/v1/datasets/gone").status_code == 200


def test_a_users_datasets_fit_their_quota(api):
    alice, bob = api.user_token("alice"), api.user_token("bob")
    first = _upload(api, "one", _npz(), alice)
    assert first.status_code == 201
    size = first.json()["stored_bytes"]
    api.settings.user_max_dataset_bytes = int(size * 1.5)  # room for one such dataset

    over = _upload(api, "two", _npz(seed=1), alice)
    assert over.status_code == 413, over.text
    assert "PHALANX_USER_MAX_DATASET_BYTES" in over.text and "datasets rm" in over.text
    # a resumable upload is refused when it opens, for what it announces...
    big = npz_bytes(x=np.zeros((200, 1, 4, 4), np.float32), y=np.arange(200) % 3)
    opened = api.post("/v1/datasets/uploads", token=alice, json={
        "name": "three", "size": len(big), "sha256": hashlib.sha256(big).hexdigest()})
    assert opened.status_code == 413, opened.text
    # ...and at completion, for what it unpacks to (a small deflated file unpacks to more)
    deflated = npz_bytes(compressed=True, x=np.zeros((400, 1, 4, 4), np.float32),
                         y=np.arange(400) % 3)
    assert len(deflated) < size // 2
    completed = _resumable(api, "four", deflated, alice)
    assert completed.status_code == 413, completed.text
    assert not list((api.settings.data_dir / "uploads").glob("upl-*"))  # dropped
    assert [p.name for p in (api.settings.data_dir / "datasets").iterdir()] == ["one"]

    assert _upload(api, "bobs", _npz(), bob).status_code == 201  # one quota per user
    assert _upload(api, "admins", _npz(seed=2), ADMIN
                   ).status_code == 201  # admins have none
    assert api.delete("/v1/datasets/one", token=alice).status_code == 200
    assert _upload(api, "two", _npz(seed=1), alice).status_code == 201  # room again


@pytest.mark.parametrize("route", ["multipart", "resumable"])
def test_concurrent_uploads_of_one_user_never_pass_the_quota_together(api, route):
    """Four uploads at once, with room for one: exactly one lands (the quota is counted
    after the insert, under the owner's lock)."""
    from concurrent.futures import ThreadPoolExecutor

    alice = api.user_token("alice")
    probe = _upload(api, "probe", _npz(), alice).json()
    assert api.delete("/v1/datasets/probe", token=alice).status_code == 200
    api.settings.user_max_dataset_bytes = int(probe["stored_bytes"] * 1.5)
    send = _upload if route == "multipart" else _resumable
    with ThreadPoolExecutor(max_workers=4) as pool:
        answers = list(pool.map(lambda k: send(api, f"r{k}", _npz(seed=k), alice), range(4)))
    assert sorted(a.status_code for a in answers) == [201, 413, 413, 413], [
        a.text for a in answers]
    assert api.count(Dataset) == 1
