"""A folder of images (one sub-folder per class) imported as a dataset, end to end against a
live server, and the ways such a folder can be wrong."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

from engine.upload import validate_npz
from phalanx import images
from phalanx.client import PhalanxClient
from tests.cli.conftest import Cli, one_line_error


def make_folder(root: Path, sizes: dict[str, list[tuple[int, int]]]) -> Path:
    """root/<class>/<i>.png, each image a noisy colour of its class."""
    rng = np.random.default_rng(0)
    for k, (label, shapes) in enumerate(sorted(sizes.items())):
        (root / label).mkdir(parents=True)
        for i, (w, h) in enumerate(shapes):
            base = np.array([200 * (k == 0), 200 * (k == 1), 200 * (k == 2)], dtype=np.int16)
            pixels = np.clip(base + rng.integers(0, 50, (h, w, 3)), 0, 255).astype(np.uint8)
            Image.fromarray(pixels).save(root / label / f"{i}.png")
    return root


def test_a_folder_imports_with_its_classes_and_normalization_and_trains(
        cli: Cli, tmp_path: Path) -> None:
    folder = make_folder(tmp_path / "pets", {"cat": [(12, 10)] * 6, "dog": [(9, 9)] * 5,
                                             "owl": [(16, 16)] * 5})
    saved = tmp_path / "pets.npz"
    done = cli("datasets", "import", str(folder), "--size", "8", "--save", str(saved))
    assert done.exit_code == 0, done.output
    assert "16 images of 3 classes (cat, dog, owl), 3x8x8" in done.stdout
    listed = {d["name"]: d for d in cli.json("datasets", "ls")}
    assert listed["pets"]["input_shape"] == [3, 8, 8] and listed["pets"]["num_classes"] == 3
    # what the server trains on: uint8 / 255, then (x - mean) / std per channel
    with np.load(saved, allow_pickle=False) as npz:
        x, mean, std = npz["x"], npz["mean"], npz["std"]
    assert x.dtype == np.uint8 and x.shape == (16, 3, 8, 8)
    np.testing.assert_allclose(mean, (x / 255.0).mean(axis=(0, 2, 3)), rtol=1e-5)
    np.testing.assert_allclose(std, (x / 255.0).std(axis=(0, 2, 3)), rtol=1e-4)
    ds = validate_npz(saved.read_bytes(), 1 << 26)
    everything = np.concatenate([ds.x_train, ds.x_val])
    np.testing.assert_allclose(everything.mean(axis=(0, 2, 3)), 0, atol=1e-5)
    np.testing.assert_allclose(everything.std(axis=(0, 2, 3)), 1, rtol=1e-4)
    spec = tmp_path / "job.yaml"
    spec.write_text("name: pets\nmodel: {arch: cnn, width: 0.25}\ndataset: pets\n"
                    "global_batch_size: 4\nshards: 2\nepochs: 1\n")
    planned = cli.json("jobs", "submit", "-f", str(spec), "--dry-run")
    assert planned["total_steps"] > 0 and planned["plan"]["parameters"] > 0


def test_a_folder_that_cannot_be_imported_says_why_in_one_line(cli: Cli, tmp_path: Path) -> None:
    one = make_folder(tmp_path / "one", {"cat": [(8, 8)] * 2})
    assert "at least two" in one_line_error(cli("datasets", "import", str(one)))
    mixed = make_folder(tmp_path / "mixed", {"a": [(8, 8)], "b": [(9, 7)]})
    line = one_line_error(cli("datasets", "import", str(mixed)))
    assert "is 9x7 but" in line and "--size" in line
    broken = make_folder(tmp_path / "broken", {"a": [(8, 8)], "b": [(8, 8)]})
    (broken / "b" / "1.png").write_bytes(b"not a png")
    assert "1.png: not a readable image" in one_line_error(
        cli("datasets", "import", str(broken)))
    empty = make_folder(tmp_path / "empty", {"a": [(8, 8)]})
    (empty / "b").mkdir()
    assert "no images" in one_line_error(cli("datasets", "import", str(empty)))


def test_grayscale_keeps_one_channel_and_moments_match_a_direct_computation(
        tmp_path: Path) -> None:
    folder = make_folder(tmp_path / "g", {"a": [(5, 5)] * 3, "b": [(5, 5)] * 3})
    got = images.load(folder, grayscale=True)
    assert got.x.shape == (6, 1, 5, 5) and list(got.y) == [0, 0, 0, 1, 1, 1]
    np.testing.assert_allclose(got.std, (got.x / 255.0).std(axis=(0, 2, 3)), rtol=1e-5)
    with np.load(io.BytesIO(got.npz()), allow_pickle=False) as npz:
        assert sorted(npz.files) == ["mean", "std", "x", "y"]


class LosesAnswers(httpx.BaseTransport):
    """A real connection to the server whose first `drops` chunk answers are lost on the way
    back: the server stored the chunk, the client saw the connection drop."""

    def __init__(self, drops: int) -> None:
        self.inner, self.drops, self.sent = httpx.HTTPTransport(), drops, 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        if request.method == "PUT":
            self.sent += 1
            if self.drops:
                self.drops -= 1
                response.read()
                raise httpx.ReadError("connection reset by peer", request=request)
        return response


def test_an_upload_resumes_where_the_server_stands_after_lost_answers(cli: Cli) -> None:
    rng = np.random.default_rng(5)
    buf = io.BytesIO()
    np.savez(buf, x=rng.random((400, 1, 8, 8), dtype=np.float32), y=np.arange(400) % 4)
    data = buf.getvalue()
    transport = LosesAnswers(drops=2)
    seen: list[int] = []
    with PhalanxClient(cli.server.url, cli.server.admin_token, transport=transport) as client:
        created = client.upload_resumable("resumed", data, on_progress=seen.append,
                                          chunk_bytes=20_000)
    assert created["name"] == "resumed" and created["n_train"] == 320
    assert seen[-1] == len(data) and seen == sorted(seen)
    chunks = -(-len(data) // 20_000)
    assert transport.sent == chunks  # each chunk sent once: the lost answers were not resent
    with cli.server.client() as c:
        listed = {d["name"]: d for d in c.get("/v1/datasets").json()["items"]}
    assert listed["resumed"]["sha256"] == hashlib.sha256(data).hexdigest()
