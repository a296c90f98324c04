"""Completing one resumable upload from several requests at once (issue 42, item 8): one
stores the dataset (201), the others are told 409, never a 500 from parts removed under
them; a complete asked again afterwards (a lost answer) is 409 naming the dataset. On the real
server (uvicorn, its thread pool), from threads."""

from __future__ import annotations

import hashlib
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np

from tests.support.arrays import npz_bytes
from tests.support.server import LiveServer

RACERS = 3
ROUNDS = 4


def _dataset(seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    n = 20_000  # ~5 MB: completing (hash, unpack, check) takes long enough to overlap
    return npz_bytes(x=rng.integers(0, 255, (n, 1, 16, 16), dtype=np.uint8),
                     y=np.arange(n) % 10)


def _uploaded(client: httpx.Client, name: str, data: bytes) -> str:
    opened = client.post("/v1/datasets/uploads", json={
        "name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    assert opened.status_code == 201, opened.text
    up = opened.json()
    step = up["chunk_max_bytes"]
    for at in range(0, len(data), step):
        sent = client.put(f"/v1/datasets/uploads/{up['id']}", params={"offset": at},
                          content=data[at : at + step],
                          headers={"Content-Type": "application/octet-stream"})
        assert sent.status_code == 200, sent.text
    return up["id"]


def test_concurrent_completes_are_one_201_and_409s(live_server: LiveServer) -> None:
    with live_server.client() as admin:
        user = admin.post("/v1/tokens", json={"name": "racer"}).json()["token"]
    with live_server.client(user) as client:
        for round_ in range(ROUNDS):
            name = f"race{round_}"
            upload_id = _uploaded(client, name, _dataset(round_))
            start = threading.Barrier(RACERS)

            def complete(_: int, upload_id: str = upload_id, start=start) -> httpx.Response:
                start.wait()
                return client.post(f"/v1/datasets/uploads/{upload_id}/complete", timeout=120)

            with ThreadPoolExecutor(max_workers=RACERS) as pool:
                answers = list(pool.map(complete, range(RACERS)))
            statuses = sorted(a.status_code for a in answers)
            assert statuses == [201] + [409] * (RACERS - 1), [a.text for a in answers]
            winner = next(a.json() for a in answers if a.status_code == 201)
            assert winner["name"] == name and winner["n_train"] == 16_000

            again = client.post(f"/v1/datasets/uploads/{upload_id}/complete")
            assert again.status_code == 409 and name in again.text, again.text
            assert client.get(f"/v1/datasets/{name}").status_code == 200
    with live_server.client() as admin:
        other = admin.post("/v1/tokens", json={"name": "other"}).json()["token"]
    with live_server.client(other) as stranger:  # a completed upload is its opener's only
        assert stranger.post(f"/v1/datasets/uploads/{upload_id}/complete").status_code == 404
    assert "Traceback" not in live_server.log()
