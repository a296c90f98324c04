"""A model as data: the user's own layer graph, checked at the layer that is wrong, and the
built-in architectures going through the same path."""

from __future__ import annotations

import numpy as np
import pytest

from engine.layerspec import LAYER_TYPES, LayerError, network
from engine.models import build_model, graph
from engine.plan import model_plan
from engine.spec import TrainSpec
from tests.support.optional import require

EVERY_LAYER = [
    {"type": "conv2d", "out_channels": 4, "kernel": 3},
    {"type": "batchnorm"}, {"type": "relu6"},
    {"type": "residual", "layers": [
        {"type": "depthwise_conv2d", "stride": 2}, {"type": "batchnorm"}, {"type": "relu"},
        {"type": "conv2d", "out_channels": 6, "kernel": 1, "bias": False}],
     "shortcut": [{"type": "conv2d", "out_channels": 6, "kernel": 1, "stride": 2}]},
    {"type": "residual", "layers": [{"type": "conv2d", "out_channels": 6}]},
    {"type": "maxpool", "kernel": 3, "stride": 2, "padding": 1},
    {"type": "avgpool", "kernel": 2, "stride": 1, "padding": 1},
    {"type": "dropout", "rate": 0.25},
    {"type": "flatten"},
    {"type": "dense", "units": 5}, {"type": "relu"}, {"type": "dense", "units": 3},
]
USED = {layer["type"] for layer in EVERY_LAYER} | {"global_avgpool"}


def _walk_types(layers):
    for layer in layers:
        yield layer["type"]
        yield from _walk_types(layer.get("layers", []) + layer.get("shortcut", []))


def test_the_test_graph_uses_every_layer_type_there_is():
    assert set(_walk_types(EVERY_LAYER)) | {"global_avgpool"} == set(LAYER_TYPES)


def test_an_own_graph_builds_names_its_parameters_by_position_and_trains_in_both_backends():
    torch = require("torch")  # noqa: F841
    from engine import torch_backend

    model = build_model("custom", (2, 8, 8), 3, {"layers": EVERY_LAYER})
    assert list(model.layout)[:2] == ["layers.0.weight", "layers.0.bias"]
    assert "layers.3.body.3.weight" in model.layout  # inside the residual block
    assert "layers.3.shortcut.0.weight" in model.layout
    params, buffers = model.init(0)
    rng = np.random.default_rng(0)
    x, y = rng.random((5, 2, 8, 8)), rng.integers(0, 3, 5)
    a = model.loss_and_grad(params.astype(np.float64), buffers, x, y, 1, 2, 3)
    b = torch_backend.loss_and_grad(model, params.astype(np.float64), buffers, x, y, 1, 2, 3)
    np.testing.assert_allclose(a.grad_sum, b.grad_sum, rtol=1e-9, atol=1e-12)
    assert a.loss_sum == pytest.approx(b.loss_sum, rel=1e-12)


def test_a_built_in_architecture_is_the_same_model_when_written_as_layers():
    layers = graph("cnn", (1, 8, 8), 10, {"width": 0.5})
    own = build_model("custom", (1, 8, 8), 10, {"layers": layers})
    built_in = build_model("cnn", (1, 8, 8), 10, {"width": 0.5})
    assert list(own.layout) == list(built_in.layout)
    assert np.array_equal(own.init(4)[0], built_in.init(4)[0])


@pytest.mark.parametrize("layers, message", [
    ([{"type": "conv2d", "out_channels": 4}, {"type": "dense", "units": 3}],
     r"model.layers\[1\] \(dense\): needs a flat input, got shape \(4, 8, 8\)"),
    ([{"type": "flatten"}, {"type": "dense", "units": 7}],
     r"model.layers: the last layer gives shape \(7,\), but the dataset has 3 classes"),
    ([{"type": "conv2d", "out_channels": 4, "kernal": 3}],
     r"model.layers\[0\] \(conv2d\): unknown option 'kernal'; options: out_channels, kernel"),
    ([{"type": "conv2d"}], r"model.layers\[0\] \(conv2d\): 'out_channels' is required"),
    ([{"type": "conv3d"}], r"model.layers\[0\]: unknown layer type 'conv3d'"),
    ([{"type": "conv2d", "out_channels": 0}],
     r"model.layers\[0\] \(conv2d\): out_channels must be an integer >= 1, got 0"),
    ([{"type": "dropout", "rate": 1.5}], r"rate must be a number in \[0, 1\)"),
    ([{"type": "maxpool", "kernel": 9}], r"a 9x9 window does not fit the 8x8 input"),
    ([{"type": "residual", "layers": [{"type": "conv2d", "out_channels": 5}]}],
     r"model.layers\[0\] \(residual\): the body gives shape \(5, 8, 8\) but its input \(the "
     r"identity\) is \(2, 8, 8\)"),
    ([{"type": "residual", "layers": [{"type": "flatten"}, {"type": "conv2d",
                                                            "out_channels": 2}]}],
     r"model.layers\[0\].layers\[1\] \(conv2d\): needs feature maps"),
    ([{"type": "conv2d", "out_channels": 4, "name": "c"}, {"type": "conv2d", "out_channels": 4,
                                                           "name": "c"}],
     r"model.layers\[1\] \(conv2d\): the name 'c' is taken by model.layers\[0\]"),
    ([{"type": "relu", "name": "layers.1"}, {"type": "relu"}],
     r"model.layers\[1\] \(relu\): the name 'layers.1' is taken by model.layers\[0\]"),
    # sizes are Python integers: 2^64 elements no longer wrap to a small plan (issue 42 item 6)
    ([{"type": "conv2d", "out_channels": 4, "padding": 2147483644}],
     r"model.layers\[0\] \(conv2d\): its output \(4, 4294967294, 4294967294\) has "
     r"73,786,976,226,118,729,744 elements per sample; at most 67,108,864"),
    ([], r"model.layers must be a non-empty list"),
    (["conv2d"], r"model.layers\[0\] must be an object with a 'type'"),
])
def test_a_bad_graph_is_refused_naming_the_layer_and_the_problem(layers, message):
    with pytest.raises(LayerError, match=message):
        network(layers, (2, 8, 8), 3)


def test_a_graph_too_deep_or_too_long_is_refused_before_it_is_walked_further():
    nested: list = [{"type": "relu"}]
    for _ in range(10):
        nested = [{"type": "residual", "layers": nested}]
    with pytest.raises(LayerError, match="nest deeper than 8"):
        network(nested + [{"type": "flatten"}, {"type": "dense", "units": 3}], (2, 8, 8), 3)
    with pytest.raises(LayerError, match="more than 2000 layers"):
        network([{"type": "relu"}] * 2001, (2, 8, 8), 3)


def test_arch_and_layers_together_are_refused():
    with pytest.raises(ValueError, match="either model.arch"):
        graph("cnn", (1, 8, 8), 10, {"layers": EVERY_LAYER})
    with pytest.raises(ValueError, match="model.layers is required"):
        graph("custom", (1, 8, 8), 10, {})


def test_the_plan_counts_parameters_flops_memory_and_bytes_of_the_graph():
    spec = TrainSpec.from_job_spec({"model": {"layers": EVERY_LAYER}, "dataset": "x",
                                    "global_batch_size": 32, "shards": 4, "epochs": 2},
                                   n_train=320)
    plan = model_plan(spec, (2, 8, 8), 3)
    model = build_model("custom", (2, 8, 8), 3, spec.model_options)
    assert spec.arch == "custom" and plan.parameters == model.n_params
    assert plan.total_steps == 20 and plan.micro_batch == 8
    conv = plan.layers[0]
    assert (conv.type, conv.out_shape, conv.macs) == ("conv2d", (4, 8, 8), 4 * 8 * 8 * 2 * 9)
    assert plan.flops_per_sample > 3 * 2 * conv.macs
    # weights and gradient carry the batch-norm buffers / statistics (2 x channels each)
    assert plan.weights_bytes == 4 * (model.n_params + model.n_buffers)
    bigger = model_plan(TrainSpec.from_job_spec({**spec.raw, "shards": 1}, n_train=320),
                        (2, 8, 8), 3)
    assert bigger.memory_bytes > plan.memory_bytes  # 32 samples a micro-batch instead of 8


def test_the_graphs_in_docs_models_md_build_on_their_datasets():
    import re
    from pathlib import Path

    import yaml

    text = (Path(__file__).resolve().parents[2] / "docs" / "models.md").read_text()
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", text, re.S)]
    shapes = [(1, 8, 8), (1, 8, 8), (3, 32, 32)]  # digits, digits, 3x32x32 images
    assert len(blocks) == len(shapes)
    for block, shape in zip(blocks, shapes):
        model = build_model("custom", shape, 10, block["model"])
        assert model.n_params > 0


def test_a_layer_output_is_capped_at_its_boundary():
    from engine.layerspec import MAX_ACTIVATION

    def graph(channels: int) -> list:
        return [{"type": "conv2d", "out_channels": channels}, {"type": "global_avgpool"},
                {"type": "dense", "units": 3}]

    network(graph(MAX_ACTIVATION // 64), (2, 8, 8), 3)  # exactly the limit: built
    with pytest.raises(LayerError, match="elements per sample; at most 67,108,864"):
        network(graph(MAX_ACTIVATION // 64 + 1), (2, 8, 8), 3)
