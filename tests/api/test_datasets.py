"""Datasets: digits is always listed; uploads are validated, stored once, and usable by jobs."""

from __future__ import annotations

import io

import numpy as np
import pytest

from domain.store.models import Dataset
from tests.support.arrays import npz_bytes


def _npz(n: int = 40, **arrays) -> bytes:
    rng = np.random.default_rng(0)
    return npz_bytes(**(arrays or {"x": rng.random((n, 1, 4, 4), dtype=np.float32),
                                   "y": np.arange(n) % 3}))


def _upload(api, name: str, data: bytes):
    return api.post("/v1/datasets", data={"name": name},
                    files={"file": (f"{name}.npz", data, "application/octet-stream")})


def test_digits_is_always_listed(api):
    items = api.get("/v1/datasets", token=api.user_token()).json()["items"]
    assert items[0]["name"] == "digits" and items[0]["builtin"] is True
    assert items[0]["input_shape"] == [1, 8, 8] and items[0]["num_classes"] == 10


def test_upload_is_stored_listed_and_usable_by_a_job(api):
    resp = _upload(api, "tiny", _npz())
    assert resp.status_code == 201, resp.text
    assert resp.json()["n_train"] == 32 and resp.json()["num_classes"] == 3
    stored = api.settings.data_dir / "datasets" / "tiny"  # unpacked: read by rows from here
    assert sorted(p.name for p in stored.iterdir()) == [".checked", "x.npy", "y.npy"]
    assert not [p for p in stored.parent.iterdir() if p.name.startswith(".")]  # no staging left
    assert [d["name"] for d in api.get("/v1/datasets").json()["items"]] == ["digits", "tiny"]
    job = api.post("/v1/jobs", json={"name": "t", "model": {"arch": "logreg"}, "dataset": "tiny",
                                     "global_batch_size": 8, "shards": 4, "epochs": 2})
    assert job.status_code == 201, job.text
    assert job.json()["total_steps"] == 2 * 4  # 4 shards of 8 samples, 2 per shard per step
    too_many = api.post("/v1/jobs", json={"name": "t", "model": {"arch": "logreg"},
                                          "dataset": "tiny", "global_batch_size": 64, "shards": 64})
    assert too_many.status_code == 422 and too_many.json()["detail"][0]["field"] == "shards"


def test_duplicate_and_reserved_names_are_409(api):
    assert _upload(api, "tiny", _npz()).status_code == 201
    again = _upload(api, "tiny", _npz(50))
    assert again.status_code == 409 and "already exists" in again.json()["detail"]
    assert _upload(api, "digits", _npz()).status_code == 409
    assert api.count(Dataset) == 1


@pytest.mark.parametrize("name, data, field", [
    ("bad", b"not a zip", "file"),
    ("bad", _npz(x=np.zeros((4, 2), np.float32)), "file"),  # no y
    ("bad", _npz(x=np.zeros((4, 2), np.float32), y=np.zeros(5, np.int64)), "file"),
    ("../etc", _npz(), "name"),
])
def test_invalid_uploads_are_422_and_store_nothing(api, name, data, field):
    resp = _upload(api, name, data)
    assert resp.status_code == 422, resp.text
    assert resp.json()["detail"][0]["field"] == field
    assert api.count(Dataset) == 0
    assert not (api.settings.data_dir / "datasets").exists() or not any(
        (api.settings.data_dir / "datasets").iterdir())


def test_upload_without_a_file_is_422(api):
    resp = api.post("/v1/datasets", data={"name": "x"})
    assert resp.status_code == 422 and "file" in [e["field"] for e in resp.json()["detail"]]


def test_upload_over_the_limit_is_413(db_url, tmp_path):
    from fastapi.testclient import TestClient

    from roots.api import create_app
    from tests.api.conftest import ADMIN, make_settings

    app = create_app(make_settings(db_url, tmp_path / "d", max_upload_bytes=2000))
    with TestClient(app) as client:
        resp = client.post("/v1/datasets", data={"name": "big"},
                           files={"file": ("big.npz", _npz(200), "application/octet-stream")},
                           headers={"Authorization": f"Bearer {ADMIN}"})
    assert resp.status_code == 413
    assert resp.json() == {"detail": "request body larger than the 2000-byte limit"}
    app.state.engine.dispose()


def test_concurrent_uploads_of_one_name_leave_one_dataset_whose_file_is_its_row(api):
    """Ten pairs of different files uploaded under one name at once: each pair gives one 201
    and one 409, and the stored arrays are the winner's (the file whose sha256 is the row's)."""
    import hashlib
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    for pair in range(10):
        name = f"race{pair}"
        files = [_npz(40 + k) for k in (0, 1)]
        with ThreadPoolExecutor(max_workers=2) as pool:
            answers = list(pool.map(lambda data, n=name: _upload(api, n, data), files))
        assert sorted(r.status_code for r in answers) == [201, 409], [r.text for r in answers]
        winner = next(r.json() for r in answers if r.status_code == 201)
        with api.app.state.session_factory() as s:
            row = s.get(Dataset, name)
        assert row.sha256 == winner["sha256"]
        sent, = [f for f in files if hashlib.sha256(f).hexdigest() == row.sha256]
        with np.load(io.BytesIO(sent)) as arrays:
            assert np.array_equal(np.load(Path(row.path) / "x.npy"), arrays["x"])
    leftovers = list((api.settings.data_dir / "datasets").glob(".*"))
    assert leftovers == []


def _open(api, name: str, data: bytes, token: str):
    import hashlib

    return api.post("/v1/datasets/uploads", token=token,
                    json={"name": name, "size": len(data),
                          "sha256": hashlib.sha256(data).hexdigest()})


def _chunk(api, upload_id: str, offset: int, chunk: bytes, token: str):
    return api.client.put(f"/v1/datasets/uploads/{upload_id}", params={"offset": offset},
                          content=chunk, headers={**api.headers(token),
                                                  "Content-Type": "application/octet-stream"})


def test_a_resumable_upload_survives_a_lost_chunk_and_lands_as_a_dataset(api):
    data = _npz(200)
    alice = api.user_token()
    opened = _open(api, "big", data, alice)
    assert opened.status_code == 201, opened.text
    up = opened.json()
    assert up["offset"] == 0 and up["size"] == len(data) and up["id"].startswith("upl-")
    third = len(data) // 3
    assert _chunk(api, up["id"], 0, data[:third], alice).json()["offset"] == third
    # the connection dropped after the second chunk was sent: the client does not know
    # whether it arrived, so it asks, then resumes from there
    assert _chunk(api, up["id"], third, data[third : 2 * third], alice).status_code == 200
    again = _chunk(api, up["id"], third, data[third : 2 * third], alice)
    assert again.status_code == 409 and f"resume from {2 * third}" in again.text
    status = api.get(f"/v1/datasets/uploads/{up['id']}", token=alice).json()
    assert status["offset"] == 2 * third
    early = api.post(f"/v1/datasets/uploads/{up['id']}/complete", token=alice)
    assert early.status_code == 409 and "send the rest" in early.text
    assert _chunk(api, up["id"], 2 * third, data[2 * third :], alice).json()["offset"] == len(data)
    done = api.post(f"/v1/datasets/uploads/{up['id']}/complete", token=alice)
    assert done.status_code == 201, done.text
    assert done.json()["name"] == "big" and done.json()["n_train"] == 160
    with np.load(io.BytesIO(data)) as sent:
        assert np.array_equal(np.load(api.settings.data_dir / "datasets" / "big" / "x.npy"),
                              sent["x"])
    assert not list((api.settings.data_dir / "uploads").glob(f"{up['id']}*"))


def test_an_upload_is_its_openers_and_checked_before_it_lands(api):
    data = _npz(50)
    alice, bob = api.user_token("alice"), api.user_token("bob")
    up = _open(api, "mine", data, alice).json()
    for answer in (api.get(f"/v1/datasets/uploads/{up['id']}", token=bob),
                   _chunk(api, up["id"], 0, data, bob),
                   api.post(f"/v1/datasets/uploads/{up['id']}/complete", token=bob),
                   api.get("/v1/datasets/uploads/upl-..%2F..%2Fetc%2Fpasswd", token=alice),
                   api.get("/v1/datasets/uploads/upl-0123", token=alice)):
        assert answer.status_code == 404, answer.text
    assert _chunk(api, up["id"], 0, data[:-1] + b"?", alice).status_code == 200
    corrupted = api.post(f"/v1/datasets/uploads/{up['id']}/complete", token=alice)
    assert corrupted.status_code == 422 and "SHA-256" in corrupted.text
    assert api.count(Dataset) == 0
    too_big = _open(api, "huge", b"x" * 10, alice)
    assert too_big.status_code == 201  # a small announced size is fine...
    over = _chunk(api, too_big.json()["id"], 0, b"x" * 11, alice)
    assert over.status_code == 413  # ...but not more bytes than announced
    assert _open(api, "digits", data, alice).status_code == 409  # reserved name
    huge = api.post("/v1/datasets/uploads", token=alice,
                    json={"name": "h", "size": 10**12, "sha256": "0" * 64})
    assert huge.status_code == 413


def test_an_upload_refused_for_good_is_dropped_and_a_token_opens_only_a_few_at_once(api):
    bob = api.user_token("bob")
    bad = b"not an npz at all"
    up = _open(api, "broken", bad, bob).json()
    assert _chunk(api, up["id"], 0, bad, bob).status_code == 200
    refused = api.post(f"/v1/datasets/uploads/{up['id']}/complete", token=bob)
    assert refused.status_code == 422 and "not an .npz" in refused.text
    assert not list((api.settings.data_dir / "uploads").glob(f"{up['id']}*"))  # gone
    opened = [_open(api, f"d{i}", bad, bob) for i in range(5)]
    assert [o.status_code for o in opened] == [201, 201, 201, 201, 409]
    assert "4 uploads are open" in opened[-1].text
