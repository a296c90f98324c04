"""Datasets: digits is always listed; uploads are validated, stored once, and usable by jobs."""

from __future__ import annotations

import numpy as np
import pytest

from api.store.models import Dataset
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
    assert (api.settings.data_dir / "datasets" / "tiny.npz").is_file()
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

    from api.main import create_app
    from tests.api.conftest import ADMIN, make_settings

    app = create_app(make_settings(db_url, tmp_path / "d", max_upload_bytes=2000))
    with TestClient(app) as client:
        resp = client.post("/v1/datasets", data={"name": "big"},
                           files={"file": ("big.npz", _npz(200), "application/octet-stream")},
                           headers={"Authorization": f"Bearer {ADMIN}"})
    assert resp.status_code == 413
    app.state.engine.dispose()


def test_concurrent_uploads_of_one_name_leave_one_dataset_whose_file_is_its_row(api):
    """Ten pairs of different files uploaded under one name at once: each pair gives one 201
    and one 409, and the stored file is the winner's, byte for byte (its sha256 is the row's)."""
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
            stored = Path(row.path).read_bytes()
        assert hashlib.sha256(stored).hexdigest() == row.sha256 == winner["sha256"]
        assert stored in files
    leftovers = list((api.settings.data_dir / "datasets").glob(".*.tmp"))
    assert leftovers == []
