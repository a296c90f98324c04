"""Whole architectures: shapes from the dataset, layout, init, gradients in both backends."""

from __future__ import annotations

import numpy as np
import pytest

from engine.models import ARCHS, build_model, layer_infos, parameter_count
from engine.spec import TrainSpec
from engine.step import compute_shard
from tests.engine.helpers import numeric_grad, sample_idx
from tests.support.optional import require

SMALL = {"width": 0.25, "hidden": 16, "dropout": 0.3, "blocks": 1}
# ImageNet-style nets downsample 32x: at 8x8 their last stages see 1x1 maps, where batch norm
# over a 6-sample batch makes float32 gradients ill-conditioned; 64x64 keeps 2x2 at the end
GRAD_SHAPE = {"resnet18": (3, 64, 64), "resnet50": (3, 64, 64), "mobilenet_v2": (3, 64, 64)}
# In float32 a deep net's ReLU masks flip where the forward's rounding crosses a kink, and batch
# norm over a small batch spreads one flip over its channel: percent-level differences between
# any two float32 implementations (torch against itself in float64 too). Float64 checks the math.
FLOAT64_ONLY = {"resnet50", "mobilenet_v2"}


def _batch(shape, n=6, k=5, seed=0):
    rng = np.random.default_rng(seed)
    return rng.random((n, *shape)), rng.integers(0, k, n)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("shape", [(1, 8, 8), (3, 16, 16), (20, 1, 1)])
def test_every_arch_builds_for_any_input_shape_and_predicts_every_class(arch, shape):
    model = build_model(arch, shape, 7, SMALL)
    params, buffers = model.init(0)
    assert params.dtype == np.float32 and params.shape == (model.n_params,)
    assert buffers.shape == (model.n_buffers,) and model.n_stats == model.n_buffers
    assert sum(s.size for s in model.layout.values()) == model.n_params
    x, _ = _batch(shape, n=3)
    assert model.logits(params, buffers, x.astype(np.float32)).shape == (3, 7)


def test_layout_names_and_init_follow_the_seed():
    model = build_model("cnn", (1, 8, 8), 10, {})
    assert list(model.layout)[:2] == ["conv1.weight", "conv1.bias"]
    assert model.layout["conv1.weight"].shape == (32, 1, 3, 3)  # torch's OIHW
    a, _ = model.init(0)
    b, _ = model.init(0)
    c, _ = model.init(1)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    w = model.layout["conv2.weight"].view(a)
    assert np.std(w) == pytest.approx(np.sqrt(2 / (32 * 9)), rel=0.1)  # He init
    assert not model.layout["conv1.bias"].view(a).any()


def test_mobilenet_width_multiplier_scales_channels_and_keeps_original_strides():
    full = build_model("mobilenet_v1", (3, 224, 224), 1000, {"width": 1.0})
    assert 4.0e6 < full.n_params < 4.5e6  # MobileNet v1 1.0-224 has 4.2M parameters
    half = build_model("mobilenet_v1", (3, 32, 32), 10, {"width": 0.5})
    assert half.layout["block13.pw.weight"].shape == (512, 512, 1, 1)


def test_unknown_arch_is_refused_by_name():
    with pytest.raises(ValueError, match="unknown arch 'vgg'"):
        build_model("vgg", (1, 8, 8), 10, {})


@pytest.mark.parametrize("arch", ARCHS)
def test_numpy_gradients_equal_torch_autograd(arch):
    require("torch")
    shape = GRAD_SHAPE.get(arch, (3, 8, 8))
    model = build_model(arch, shape, 5, SMALL)
    params, buffers = model.init(1)
    x, y = _batch(shape)
    spec = TrainSpec.from_job_spec({"model": {"arch": arch}, "dataset": "digits", "seed": 3,
                                    "global_batch_size": 6, "shards": 1})
    checks = ((np.float64, 1e-9),) if arch in FLOAT64_ONLY else ((np.float64, 1e-9),
                                                                (np.float32, 1e-4))
    for dtype, rtol in checks:
        p = params.astype(dtype)
        a = model.loss_and_grad(p, buffers, x.astype(dtype), y, 3, 4, 5)
        from engine import torch_backend

        b = torch_backend.loss_and_grad(model, p, buffers, x.astype(dtype), y, 3, 4, 5)
        scale = np.abs(b.grad_sum).max()
        np.testing.assert_allclose(a.grad_sum, b.grad_sum, rtol=rtol, atol=rtol * scale)
        assert a.loss_sum == pytest.approx(b.loss_sum, rel=rtol)
        assert a.correct == b.correct
        np.testing.assert_allclose(a.stats, b.stats, rtol=rtol, atol=rtol)
    if arch in FLOAT64_ONLY:
        return
    r_np = compute_shard(model, params, buffers, x.astype(np.float32), y, spec, 4, 5)
    r_t = compute_shard(model, params, buffers, x.astype(np.float32), y, spec, 4, 5, "torch")
    np.testing.assert_allclose(r_np.grad_sum, r_t.grad_sum, rtol=1e-4,
                               atol=1e-4 * np.abs(r_t.grad_sum).max())


# resnet50 and mobilenet_v2: too many kinks for central differences at any useful eps; every
# layer they use is checked alone (test_layers.py) and the whole net against torch in float64
@pytest.mark.parametrize("arch", [a for a in ARCHS if a not in FLOAT64_ONLY])
def test_model_gradient_matches_finite_differences(arch):
    shape = (2, 6, 6)
    model = build_model(arch, shape, 4, SMALL)
    params, buffers = model.init(4)  # seed 2 puts a mobilenet_v1 relu6 input within eps of 6
    p = params.astype(np.float64)
    x, y = _batch(shape, n=5, k=4)
    grad = model.loss_and_grad(p, buffers, x, y, 1, 2, 3).grad_sum
    idx = np.concatenate([sample_idx(p.size, 20), np.argsort(-np.abs(grad))[:5]])
    # eps 1e-7: BN on a 5-sample batch makes the loss sharply curved; float64 keeps it exact
    num = numeric_grad(lambda: model.loss_and_grad(p, buffers, x, y, 1, 2, 3).loss_sum, p, idx,
                       eps=1e-7)
    np.testing.assert_allclose(grad[idx], num, rtol=1e-4, atol=1e-6)


# torchvision's counts at 224x224 with 1000 classes (batch-norm scale and shift included)
PUBLISHED = {"resnet18": 11_689_512, "resnet50": 25_557_032, "mobilenet_v2": 3_504_872,
             "mobilenet_v1": 4_231_976}


@pytest.mark.parametrize("arch", list(PUBLISHED))
def test_full_size_models_have_the_published_parameter_counts(arch):
    assert parameter_count(arch, (3, 224, 224), 1000) == PUBLISHED[arch]


def test_resnet50_keeps_torchvision_names_and_strides():
    model = build_model("resnet50", (3, 224, 224), 1000)
    assert model.layout["conv1.weight"].shape == (64, 3, 7, 7)
    assert model.layout["layer4.2.conv3.weight"].shape == (2048, 512, 1, 1)
    assert model.layout["layer2.0.downsample.0.weight"].shape == (512, 256, 1, 1)
    assert model.layout["fc.weight"].shape == (1000, 2048)
    infos = layer_infos("resnet50", (3, 224, 224), 1000)
    # 7x7 stem at stride 2, max pool at stride 2, then 56, 28, 14, 7
    assert [i.out_shape for i in infos if i.type == "maxpool"] == [(64, 56, 56)]
    assert [i.out_shape for i in infos if i.type == "residual"][-1] == (2048, 7, 7)
    # ~4.1 G multiply-adds per 224x224 image, as published for ResNet-50
    assert 4.0e9 < sum(i.macs for i in infos if i.type in ("conv2d", "dense")) < 4.2e9
