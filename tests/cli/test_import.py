"""`phalanx models import`: torchvision's ResNet-18 and MobileNet v2, exported by
torch.onnx.export, come in as model.layers that the engine builds with torchvision's parameter
count and forward, and the server accepts; an operator the layers cannot express is refused by
name and node."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from engine.models import CUSTOM, build_model, parameter_count
from tests.cli.conftest import Cli, one_line_error
from tests.support.optional import require
from tests.support.torchvision_cpu import torchvision

SHAPE = (3, 32, 32)


class Exported:
    """A torchvision model (10 classes), batch norm statistics drawn so they matter, and its
    ONNX file."""

    def __init__(self, name: str, folder: Path) -> None:
        torch = require("torch")
        gen = torch.Generator().manual_seed(0)
        self.net = getattr(torchvision().models, name)(num_classes=10).eval()
        for module in self.net.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.normal_(0, 0.1, generator=gen)
                module.running_var.uniform_(0.5, 2.0, generator=gen)
                module.bias.data.normal_(0, 0.1, generator=gen)
        self.count = sum(p.numel() for p in self.net.parameters())
        self.path = folder / f"{name}.onnx"
        # the TorchScript exporter, batch norm kept (constant folding would fold it into the
        # convolutions, which then have biases and other counts); deprecated, still there
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            torch.onnx.export(self.net, (torch.zeros(1, *SHAPE),), str(self.path),
                              dynamo=False, do_constant_folding=False)

    def forward(self, x: np.ndarray) -> np.ndarray:
        torch = require("torch")
        with torch.no_grad():
            return self.net(torch.from_numpy(x)).numpy()


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Exported]:
    """Each torchvision model exported once for the module, when a test first asks."""
    made: dict[str, Exported] = {}

    def get(name: str) -> Exported:
        if name not in made:
            made[name] = Exported(name, tmp_path_factory.mktemp(name))
        return made[name]

    return get


@pytest.fixture(params=["resnet18", "mobilenet_v2"])
def exported(request: pytest.FixtureRequest, zoo: Callable[[str], Exported]) -> Exported:
    return zoo(request.param)


def imported(cli: Cli, model: Path, *args: str) -> tuple[list[dict[str, Any]], str]:
    result = cli("models", "import", str(model), *args, server=None, token=None)
    assert result.exit_code == 0, result.output
    return yaml.safe_load(result.stdout)["model"]["layers"], result.stdout


def engine_forward(layers: list[dict[str, Any]], weights: Path, x: np.ndarray) -> np.ndarray:
    model = build_model(CUSTOM, SHAPE, 10, {"layers": layers})
    params = np.zeros(model.n_params, np.float32)
    buffers = np.zeros(model.n_buffers, np.float32)
    with np.load(weights, allow_pickle=False) as arrays:
        for name, s in model.layout.items():
            s.view(params)[...] = arrays[name]
        for name, s in model.buffer_layout.items():
            s.view(buffers)[...] = arrays[name]
    return model.logits(params, buffers, x)


def test_torchvision_models_come_in_with_their_parameter_count_and_forward(
        exported: Exported, cli: Cli, tmp_path: Path) -> None:
    weights = tmp_path / "weights.npz"
    layers, text = imported(cli, exported.path, "--weights", str(weights))
    assert parameter_count(CUSTOM, SHAPE, 10, {"layers": layers}) == exported.count
    assert f"# {exported.count:,} parameters on 3x32x32 inputs with 10 classes" in text
    x = np.random.default_rng(0).normal(size=(2, *SHAPE)).astype(np.float32)
    got = engine_forward(layers, weights, x)
    np.testing.assert_allclose(got, exported.forward(x), rtol=1e-4, atol=1e-4)


def test_the_server_accepts_the_imported_layers_and_plans_the_same_count(
        exported: Exported, cli: Cli, tmp_path: Path) -> None:
    layers, _ = imported(cli, exported.path)
    spec = {"name": f"imported-{exported.path.stem}", "model": {"layers": layers},
            "dataset": "synthetic:3x32x32:10", "global_batch_size": 64, "shards": 4,
            "epochs": 1, "placement": {"selector": {"rack": "nowhere"}}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    job = cli.json("jobs", "submit", "-f", str(tmp_path / "job.yaml"))
    assert job["spec"]["model"]["arch"] == "custom"
    assert cli.json("jobs", "describe", job["id"])["plan"]["parameters"] == exported.count


def test_an_imported_model_exports_back_to_onnx_that_computes_torchs_forward(
        zoo: Callable[[str], Exported], cli: Cli, tmp_path: Path) -> None:
    """Import with the weights, export offline: the ONNX Runtime output is torch's."""
    ort = require("onnxruntime")
    exported = zoo("resnet18")
    layers, _ = imported(cli, exported.path, "--weights", str(tmp_path / "w.npz"))
    spec = {"model": {"layers": layers}, "dataset": "synthetic:3x32x32:10"}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(spec))
    result = cli("models", "export", "--spec", str(tmp_path / "job.yaml"), "--params",
                 str(tmp_path / "w.npz"), "-O", str(tmp_path / "back.onnx"), server=None,
                 token=None)
    assert result.exit_code == 0, result.output
    x = np.random.default_rng(1).normal(size=(2, *SHAPE)).astype(np.float32)
    session = ort.InferenceSession(str(tmp_path / "back.onnx"),
                                   providers=["CPUExecutionProvider"])
    got = session.run(["logits"], {"input": x})[0]
    np.testing.assert_allclose(got, exported.forward(x), rtol=1e-4, atol=1e-4)


def onnx_graph(path: Path, nodes: list[Any], inits: dict[str, np.ndarray],
               in_shape: list[Any], out_shape: list[Any]) -> Path:
    onnx = require("onnx")
    h, f32 = onnx.helper, onnx.TensorProto.FLOAT
    tensors = [onnx.numpy_helper.from_array(v, k) for k, v in inits.items()]
    graph = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", f32, in_shape)],
                         [h.make_tensor_value_info("y", f32, out_shape)], tensors)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    path.write_bytes(model.SerializeToString())
    return path


def test_the_dynamo_exporters_mean_reshape_and_matmul_come_in_as_the_same_function(
        cli: Cli, tmp_path: Path) -> None:
    """torch.onnx.export's default exporter pools with ReduceMean and classifies with
    Reshape and Gemm or MatMul + Add: a graph of those, and ONNX Runtime agrees with the
    engine on the imported layers and weights."""
    onnx, ort = require("onnx"), require("onnxruntime")
    h = onnx.helper
    rng = np.random.default_rng(2)
    inits = {"c.weight": rng.normal(size=(4, 2, 3, 3)).astype(np.float32),
             "c.bias": rng.normal(size=4).astype(np.float32),
             "lo": np.array(0, np.float32), "hi": np.array(6, np.float32),
             "axes": np.array([2, 3], np.int64), "shape": np.array([-1, 4], np.int64),
             "fc.weight": rng.normal(size=(4, 3)).astype(np.float32),
             "fc.bias": rng.normal(size=3).astype(np.float32)}
    nodes = [h.make_node("Conv", ["x", "c.weight", "c.bias"], ["a"], name="conv",
                         kernel_shape=[3, 3], pads=[1, 1, 1, 1], strides=[2, 2]),
             h.make_node("Clip", ["a", "lo", "hi"], ["b"], name="clip"),
             h.make_node("ReduceMean", ["b", "axes"], ["c"], name="mean", keepdims=1),
             h.make_node("Reshape", ["c", "shape"], ["d"], name="view"),
             h.make_node("MatMul", ["d", "fc.weight"], ["e"], name="matmul"),
             h.make_node("Add", ["e", "fc.bias"], ["y"], name="bias")]
    path = onnx_graph(tmp_path / "g.onnx", nodes, inits, ["N", 2, 6, 6], ["N", 3])
    layers, _ = imported(cli, path, "--weights", str(tmp_path / "w.npz"))
    assert [layer["type"] for layer in layers] == ["conv2d", "relu6", "global_avgpool", "dense"]
    assert (layers[0]["name"], layers[-1]["name"]) == ("c", "fc")  # after their weights
    model = build_model(CUSTOM, (2, 6, 6), 3, {"layers": layers})
    with np.load(tmp_path / "w.npz", allow_pickle=False) as arrays:
        params = np.concatenate([arrays[n].ravel() for n in model.layout]).astype(np.float32)
    x = rng.normal(size=(2, 2, 6, 6)).astype(np.float32)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(
        ["y"], {"x": x})[0]
    got = model.logits(params, np.zeros(0, np.float32), x)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_weight_names_that_are_other_layers_places_do_not_clash(cli: Cli, tmp_path: Path) -> None:
    """A torch attribute called `layers` names weights `layers.4.weight`, which is where the
    engine puts an unnamed layer: that name gets a suffix, the others stay torch's."""
    torch = require("torch")

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            nn = torch.nn
            self.layers = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                        nn.Flatten(), nn.Linear(4, 5), nn.ReLU(),
                                        nn.Linear(5, 10))

        def forward(self, x: Any) -> Any:
            return self.layers(x)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(Net().eval(), (torch.zeros(1, 3, 8, 8),), str(tmp_path / "n.onnx"),
                          dynamo=False)
    layers, _ = imported(cli, tmp_path / "n.onnx")
    assert [layer.get("name") for layer in layers] == [
        "layers.0", None, None, "layers.4_1", None, "layers.6"]
    assert parameter_count(CUSTOM, (3, 8, 8), 10, {"layers": layers}) == 4 * 28 + 25 + 60


def test_an_unsupported_operator_is_refused_naming_it_and_its_node(
        cli: Cli, tmp_path: Path) -> None:
    torch = require("torch")
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Softmax(dim=1),
                              torch.nn.Flatten(), torch.nn.Linear(4 * 30 * 30, 10)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(net, (torch.zeros(1, *SHAPE),), str(tmp_path / "softmax.onnx"),
                          dynamo=False)
    node = next(n for n in require("onnx").load(str(tmp_path / "softmax.onnx")).graph.node
                if n.op_type == "Softmax")
    line = one_line_error(cli("models", "import", str(tmp_path / "softmax.onnx"),
                              server=None, token=None))
    assert f"unsupported operator Softmax (node '{node.name}')" in line, line

    h = require("onnx").helper
    rng = np.random.default_rng(3)
    inits = {"w": rng.normal(size=(1, 32, 6)).astype(np.float32),
             "r": rng.normal(size=(1, 32, 8)).astype(np.float32)}
    nodes = [h.make_node("Relu", ["x"], ["seq"], name="relu"),
             h.make_node("LSTM", ["seq", "w", "r"], ["y"], name="the_lstm", hidden_size=8)]
    path = onnx_graph(tmp_path / "lstm.onnx", nodes, inits, [6, 1, 6], [6, 1, 1, 8])
    line = one_line_error(cli("models", "import", str(path), server=None, token=None))
    assert "unsupported operator LSTM (node 'the_lstm')" in line, line


def test_what_the_layers_cannot_express_is_refused_with_the_reason(
        cli: Cli, tmp_path: Path) -> None:
    h = require("onnx").helper
    w = np.zeros((4, 1, 3, 3), np.float32)
    grouped = [h.make_node("Conv", ["x", "w"], ["y"], name="grouped", group=2,
                           kernel_shape=[3, 3], pads=[1, 1, 1, 1])]
    path = onnx_graph(tmp_path / "g.onnx", grouped, {"w": w}, [1, 2, 4, 4], [1, 4, 4, 4])
    line = one_line_error(cli("models", "import", str(path), server=None, token=None))
    assert "Conv node 'grouped': a grouped convolution (group=2)" in line, line
    (tmp_path / "junk.onnx").write_bytes(b"\x00not a model")
    line = one_line_error(cli("models", "import", str(tmp_path / "junk.onnx"), server=None,
                              token=None))
    assert "junk.onnx" in line


def test_without_the_export_extra_the_command_says_what_to_install(
        cli: Cli, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "onnx", None)  # as if it were not installed
    (tmp_path / "m.onnx").write_bytes(b"")
    line = one_line_error(cli("models", "import", str(tmp_path / "m.onnx"), server=None,
                              token=None))
    assert "this needs the onnx package: pip install 'phalanx[export]'" in line, line
