"""`phalanx jobs export` and `phalanx models export`: a trained model leaves as ONNX (run in
ONNX Runtime, equal to the engine's forward), safetensors and a torch state_dict that load
into torchvision's module by name with strict=True."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from engine.checkpoint import save_npz, state_to_arrays
from engine.models import ARCHS
from engine.runner import JobModel, job_model, shard_gradient
from engine.step import apply_step, initial_state
from tests.cli.conftest import Cli, one_line_error
from tests.support.optional import require
from tests.support.server import LiveServer
from tests.support.torchvision_cpu import torchvision
from tests.support.waiting import wait_for

OWN_LAYERS = [
    {"type": "conv2d", "out_channels": 8, "bias": False},
    {"type": "batchnorm"},
    {"type": "relu6"},
    {"type": "residual", "name": "block",
     "layers": [{"type": "depthwise_conv2d", "stride": 2}, {"type": "batchnorm"},
                {"type": "relu"}, {"type": "conv2d", "out_channels": 16, "kernel": 1}],
     "shortcut": [{"type": "avgpool", "kernel": 3, "stride": 2, "padding": 1},
                  {"type": "conv2d", "out_channels": 16, "kernel": 1, "padding": 0}]},
    {"type": "maxpool", "kernel": 3, "stride": 1, "padding": 1},
    {"type": "flatten"},
    {"type": "dropout", "rate": 0.2},
    {"type": "dense", "units": 12, "name": "hidden"},
    {"type": "batchnorm"},
    {"type": "relu"},
    {"type": "dense", "units": 10, "name": "classifier"},
]
# every built-in at a small width, on the dataset (synthetic: shape and classes in its name)
MODELS: dict[str, tuple[dict[str, Any], str]] = {
    "logreg": ({"arch": "logreg"}, "synthetic:1x8x8:10"),
    "mlp": ({"arch": "mlp", "hidden": 16, "dropout": 0.2}, "synthetic:1x8x8:10"),
    "cnn": ({"arch": "cnn", "width": 0.25, "dropout": 0.1}, "synthetic:3x16x16:10"),
    "mobilenet_v1": ({"arch": "mobilenet_v1", "width": 0.125}, "synthetic:3x32x32:10"),
    "resnet": ({"arch": "resnet", "width": 0.5}, "synthetic:3x16x16:10"),
    "resnet18": ({"arch": "resnet18", "width": 0.125}, "synthetic:3x32x32:10"),
    "resnet50": ({"arch": "resnet50", "width": 0.125}, "synthetic:3x32x32:10"),
    "mobilenet_v2": ({"arch": "mobilenet_v2", "width": 0.25}, "synthetic:3x32x32:10"),
    "layers": ({"layers": OWN_LAYERS}, "synthetic:3x16x16:10"),
}


def spec_of(model: dict[str, Any], dataset: str) -> dict[str, Any]:
    # a small learning rate: after a step batch norm's running statistics have moved and the
    # weights are still of the size a trained net has (lr 0.1 sends resnet50's logits to 1e5)
    return {"name": "exported", "model": model, "dataset": dataset, "global_batch_size": 8,
            "shards": 2, "epochs": 1, "optimizer": {"lr": 0.001}}


def trained_one_step(spec: dict[str, Any], shape: tuple[int, int, int],
                     seed: int = 0) -> tuple[JobModel, dict[str, np.ndarray]]:
    """The model after one real training step (batch norm's running statistics moved off
    their 0 and 1), as the checkpoint's arrays."""
    n, shards = spec["global_batch_size"], spec["shards"]
    job = job_model(spec, n, shape, 10)  # one step per epoch
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, *shape)).astype(np.float32)
    y = rng.integers(0, 10, n)
    state = initial_state(job.model, job.spec)
    results = [shard_gradient(job, state.params, state.buffers, x[k::shards], y[k::shards], 0,
                              k) for k in range(shards)]
    state, _ = apply_step(job.model, job.spec, state, results)
    return job, state_to_arrays(job.model, state)


def engine_logits(job: JobModel, arrays: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    model = job.model
    params = np.zeros(model.n_params, np.float32)
    buffers = np.zeros(model.n_buffers, np.float32)
    for name, s in model.layout.items():
        s.view(params)[...] = arrays[name]
    for name, s in model.buffer_layout.items():
        s.view(buffers)[...] = arrays[name]
    return model.logits(params, buffers, x)


def run_onnx(path: Path, x: np.ndarray) -> np.ndarray:
    onnx, ort = require("onnx"), require("onnxruntime")
    proto = onnx.load(str(path))
    onnx.checker.check_model(proto, full_check=True)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(["logits"], {"input": x})[0]


def assert_close(got: np.ndarray, want: np.ndarray, tol: float) -> None:
    """Equal within `tol` of the logits' scale (float32 rounding grows with the values)."""
    assert got.shape == want.shape
    scale = max(1.0, float(np.abs(want).max()))
    assert float(np.abs(got - want).max()) <= tol * scale, (np.abs(got - want).max(), scale)


@pytest.fixture(scope="module")
def cluster_job(shared_server: LiveServer, tmp_path_factory: pytest.TempPathFactory
                ) -> Iterator[tuple[str, dict[str, Any]]]:
    """A one-step job trained by a light simulated phone. The phone's last long poll holds it
    ~10 s after the job ends: it is stopped and joined at the module's end, so this module's
    first test uses it and the others run meanwhile."""
    from phalanx.sim.fleet import FleetOptions, run_fleet

    spec = dict(spec_of({"arch": "cnn", "width": 0.25}, "synthetic:1x8x8:10:16"),
                global_batch_size=16, placement={"selector": {"pool": "export"}})
    with shared_server.client() as admin:
        created = admin.post("/v1/jobs", json=spec)
        assert created.status_code == 201, created.text
        job_id = created.json()["id"]
        stop = threading.Event()
        fleet = threading.Thread(target=run_fleet, args=(FleetOptions(
            server=shared_server.url, phones=1, duration_s=60, interval_s=0.2, compute=True,
            admin_token=shared_server.admin_token, labels={"pool": "export"},
            follow_job=job_id, stop=stop),), daemon=True)
        fleet.start()
        wait_for("the job to succeed",
                 lambda: admin.get(f"/v1/jobs/{job_id}").json()["state"] == "Succeeded",
                 timeout=60)
    yield job_id, spec
    stop.set()
    fleet.join(timeout=30)
    assert not fleet.is_alive()


def test_a_job_trained_on_the_cluster_exports_from_the_server(
        cluster_job: tuple[str, dict[str, Any]], cli: Cli, tmp_path: Path) -> None:
    """`jobs export` rebuilds the model from the server's spec, dataset and checkpoint, and
    its ONNX computes what the engine computes with that checkpoint."""
    job_id, spec = cluster_job
    got = cli("jobs", "export", job_id, "-O", str(tmp_path / "m.onnx"))
    assert got.exit_code == 0, got.output
    assert "m.onnx: onnx" in got.stdout and "step 1" in got.stdout
    pulled = cli("jobs", "checkpoint", job_id, "-O", str(tmp_path / "c.npz"))
    assert pulled.exit_code == 0, pulled.output
    with np.load(tmp_path / "c.npz", allow_pickle=False) as npz:
        arrays = {k: npz[k] for k in npz.files}
    job = job_model(spec, 16, (1, 8, 8), 10)
    x = np.random.default_rng(3).normal(size=(4, 1, 8, 8)).astype(np.float32)
    assert_close(run_onnx(tmp_path / "m.onnx", x), engine_logits(job, arrays, x), 1e-5)
    proto = require("onnx").load(str(tmp_path / "m.onnx"))
    assert {p.key: p.value for p in proto.metadata_props}["job"] == job_id


def test_every_builtin_is_exported() -> None:
    assert set(MODELS) == {*ARCHS, "layers"}


@pytest.mark.parametrize("key", list(MODELS))
def test_onnx_of_every_model_runs_in_onnxruntime_as_the_engine_computes(
        key: str, cli: Cli, tmp_path: Path) -> None:
    model, dataset = MODELS[key]
    spec = spec_of(model, dataset)
    shape = tuple(int(d) for d in dataset.split(":")[1].split("x"))
    job, arrays = trained_one_step(spec, shape)  # type: ignore[arg-type]
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    (tmp_path / "ckpt.npz").write_bytes(save_npz(arrays))
    result = cli("models", "export", "--spec", str(tmp_path / "job.yaml"), "--params",
                 str(tmp_path / "ckpt.npz"), "--format", "onnx", server=None, token=None)
    assert result.exit_code == 0, result.output
    assert f"{job.model.n_params:,} parameters, step 1" in result.stdout
    x = np.random.default_rng(1).normal(size=(3, *shape)).astype(np.float32)
    assert_close(run_onnx(tmp_path / "ckpt.onnx", x), engine_logits(job, arrays, x), 1e-5)


@pytest.fixture(scope="module")
def resnet18(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, JobModel, dict]:
    """torchvision's ResNet-18 (width 1, 10 classes) after a step, as a checkpoint file."""
    folder = tmp_path_factory.mktemp("resnet18")
    spec = dict(spec_of({"arch": "resnet18"}, "synthetic:3x32x32:10"), global_batch_size=2,
                shards=1)
    job, arrays = trained_one_step(spec, (3, 32, 32))
    (folder / "job.yaml").write_text(yaml.safe_dump(spec))
    (folder / "ckpt.npz").write_bytes(save_npz(arrays))
    return folder, job, arrays


@pytest.mark.parametrize("fmt", ["safetensors", "torch"])
def test_resnet18_loads_into_torchvision_strictly_and_computes_the_engines_forward(
        fmt: str, resnet18: tuple[Path, JobModel, dict], cli: Cli) -> None:
    torch, tv = require("torch"), torchvision()
    folder, job, arrays = resnet18
    out = folder / f"weights.{fmt}"
    result = cli("models", "export", "--spec", str(folder / "job.yaml"), "--params",
                 str(folder / "ckpt.npz"), "--format", fmt, "-O", str(out), server=None,
                 token=None)
    assert result.exit_code == 0, result.output
    if fmt == "safetensors":
        from safetensors.torch import load_file

        state = load_file(str(out))
    else:
        state = torch.load(out, weights_only=True)
    net = tv.models.resnet18(num_classes=10)
    net.load_state_dict(state, strict=True)  # every parameter and buffer, by name
    assert int(state["bn1.num_batches_tracked"]) == 1
    x = np.random.default_rng(2).normal(size=(2, 3, 32, 32)).astype(np.float32)
    with torch.no_grad():
        got = net.eval()(torch.from_numpy(x)).numpy()
    assert_close(got, engine_logits(job, arrays, x), 1e-4)


def test_export_refusals_are_one_line(cli: Cli, tmp_path: Path) -> None:
    spec = dict(spec_of({"arch": "logreg"}, "synthetic:1x8x8:10"),
                placement={"selector": {"rack": "nowhere"}})
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    job_id = cli.json("jobs", "submit", "-f", str(tmp_path / "job.yaml"))["id"]
    line = one_line_error(cli("jobs", "export", job_id, "-O", str(tmp_path / "m.onnx")))
    assert "no checkpoint yet" in line
    (tmp_path / "other.npz").write_bytes(save_npz({"w": np.zeros(3, np.float32)}))
    line = one_line_error(cli("models", "export", "--spec", str(tmp_path / "job.yaml"),
                              "--params", str(tmp_path / "other.npz"), server=None, token=None))
    assert "no array 'fc.weight'" in line
    (tmp_path / "junk.npz").write_bytes(b"not an npz")
    line = one_line_error(cli("models", "export", "--spec", str(tmp_path / "job.yaml"),
                              "--params", str(tmp_path / "junk.npz"), server=None, token=None))
    assert "junk.npz is not an .npz" in line
