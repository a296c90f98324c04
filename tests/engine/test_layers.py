"""Every layer's backward against finite differences (float64) and against torch autograd."""

from __future__ import annotations

import numpy as np
import pytest

from engine.base import to_nchw, to_nhwc
from engine.conv import Conv2d, DepthwiseConv2d
from engine.graph import Residual
from engine.layers import (
    AvgPool,
    Dense,
    Dropout,
    Flatten,
    GlobalAvgPool,
    MaxPool,
    ReLU,
    ReLU6,
    softmax_cross_entropy,
)
from engine.norm import BatchNorm
from tests.engine.helpers import Bound, numeric_grad, sample_idx
from tests.support.optional import require

CASES = {
    "dense": (lambda: Dense(5, "fc"), (7,)),
    "conv 3x3": (lambda: Conv2d(4, 3, "c"), (3, 6, 6)),
    "conv 3x3 stride 2": (lambda: Conv2d(4, 3, "c", stride=2), (3, 7, 7)),
    "conv 3x3 no padding, no bias": (lambda: Conv2d(2, 3, "c", pad=0, bias=False), (3, 5, 6)),
    "conv 1x1 pointwise": (lambda: Conv2d(5, 1, "c", pad=0), (3, 4, 4)),
    "conv 1x1 stride 2": (lambda: Conv2d(5, 1, "c", stride=2, pad=0), (3, 5, 5)),
    "depthwise 3x3": (lambda: DepthwiseConv2d(3, "dw"), (4, 6, 6)),
    "depthwise 3x3 stride 2": (lambda: DepthwiseConv2d(3, "dw", stride=2), (4, 7, 7)),
    "batchnorm on feature maps": (lambda: BatchNorm("bn"), (3, 4, 4)),
    "batchnorm on features": (lambda: BatchNorm("bn"), (6,)),
    "relu": (lambda: ReLU(), (3, 4, 4)),
    "relu6": (lambda: ReLU6(), (3, 4, 4)),
    "max pool 2": (lambda: MaxPool(2), (3, 6, 6)),
    "max pool 3 stride 2": (lambda: MaxPool(3, 2), (3, 7, 7)),
    "avg pool 2": (lambda: AvgPool(2), (3, 5, 5)),
    "max pool 3 stride 2 pad 1 (resnet stem)": (lambda: MaxPool(3, 2, 1), (3, 7, 7)),
    "avg pool 3 stride 2 pad 1": (lambda: AvgPool(3, 2, 1), (3, 6, 6)),
    "global average pool": (lambda: GlobalAvgPool(), (3, 4, 5)),
    "flatten": (lambda: Flatten(), (3, 2, 4)),
    "dropout": (lambda: Dropout(0.4), (3, 4, 4)),
    "residual block with projection": (
        lambda: Residual([Conv2d(4, 3, "a", stride=2), BatchNorm("bn"), ReLU(),
                          Conv2d(4, 3, "b")], [Conv2d(4, 1, "down", stride=2, pad=0)]),
        (2, 6, 6)),
}


def _input(shape: tuple[int, ...], n: int = 4, seed: int = 1) -> np.ndarray:
    """Canonical (N, C, H, W) or (N, F) float64 input spread over ReLU6's two kinks."""
    return np.random.default_rng(seed).standard_normal((n, *shape)) * 4.0


def _numpy_loss_and_grads(bound: Bound, x_canon: np.ndarray, r_canon: np.ndarray):
    """loss = sum(y * r); returns loss, dL/dx (canonical layout) and dL/dparams."""
    ctx = bound.ctx()
    y, cache = bound.layer.forward(to_nhwc(x_canon), bound.P(bound.params), ctx)
    grads = np.zeros_like(bound.params)
    dx = bound.layer.backward(to_nhwc(r_canon), cache, bound.P(bound.params), bound.P(grads))
    return float((to_nchw(y) * r_canon).sum()), to_nchw(dx), grads


@pytest.mark.parametrize("case", list(CASES))
def test_backward_matches_finite_differences(case):
    make, shape = CASES[case]
    bound = Bound(make(), shape)
    x = _input(shape)
    r = np.random.default_rng(2).standard_normal((4, *bound.out_shape))
    _, dx, grads = _numpy_loss_and_grads(bound, x, r)

    def loss() -> float:
        return _numpy_loss_and_grads(bound, x, r)[0]

    idx = sample_idx(x.size, 25)
    np.testing.assert_allclose(dx.reshape(-1)[idx], numeric_grad(loss, x, idx), rtol=1e-5,
                               atol=1e-7)
    if bound.params.size:
        idx = sample_idx(bound.params.size, 25)
        np.testing.assert_allclose(grads[idx], numeric_grad(loss, bound.params, idx),
                                   rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("case", list(CASES))
def test_backward_matches_torch_autograd(case):
    torch = require("torch")
    make, shape = CASES[case]
    bound = Bound(make(), shape)
    x = _input(shape)
    r = np.random.default_rng(2).standard_normal((4, *bound.out_shape))
    loss, dx, grads = _numpy_loss_and_grads(bound, x, r)

    flat = torch.tensor(bound.params, requires_grad=True)
    xt = torch.tensor(x, requires_grad=True)
    ctx = bound.ctx()
    ctx.buffers = {k: torch.from_numpy(v) for k, v in ctx.buffers.items()}
    yt = bound.layer.torch_forward(xt, bound.P(flat), ctx)
    lt = (yt * torch.from_numpy(r)).sum()
    lt.backward()
    assert lt.item() == pytest.approx(loss, rel=1e-10)
    np.testing.assert_allclose(dx, xt.grad.numpy(), rtol=1e-4, atol=1e-10)
    if bound.params.size:
        np.testing.assert_allclose(grads, flat.grad.numpy(), rtol=1e-4, atol=1e-10)


@pytest.mark.parametrize("training", [True, False])
def test_batchnorm_reports_the_same_statistics_in_both_backends(training):
    torch = require("torch")
    bound = Bound(BatchNorm("bn"), (3, 4, 4))
    x = _input((3, 4, 4))
    ctx = bound.ctx(training)
    y, _ = bound.layer.forward(to_nhwc(x), bound.P(bound.params), ctx)
    tctx = bound.ctx(training)
    tctx.buffers = {k: torch.from_numpy(v) for k, v in tctx.buffers.items()}
    yt = bound.layer.torch_forward(torch.from_numpy(x), bound.P(torch.from_numpy(bound.params)),
                                   tctx)
    np.testing.assert_allclose(to_nchw(y), yt.detach().numpy(), rtol=1e-10, atol=1e-12)
    if training:
        per_channel = x.transpose(1, 0, 2, 3).reshape(3, -1)
        np.testing.assert_allclose(ctx.stats["bn.running_mean"], per_channel.mean(axis=1))
        np.testing.assert_allclose(ctx.stats["bn.running_var"], per_channel.var(axis=1, ddof=1))
        for key in ctx.stats:
            np.testing.assert_allclose(ctx.stats[key], tctx.stats[key].numpy(), rtol=1e-10)


def test_max_pool_gives_a_tied_window_gradient_to_its_first_element_like_torch():
    torch = require("torch")
    x = np.zeros((1, 1, 2, 2))
    bound = Bound(MaxPool(2), (1, 2, 2))
    _, dx, _ = _numpy_loss_and_grads(bound, x, np.ones((1, 1, 1, 1)))
    xt = torch.zeros((1, 1, 2, 2), dtype=torch.float64, requires_grad=True)
    torch.nn.functional.max_pool2d(xt, 2).sum().backward()
    np.testing.assert_array_equal(dx, xt.grad.numpy())
    assert dx.sum() == 1.0


def test_dropout_masks_depend_on_seed_step_shard_and_layer_only():
    layer = Dropout(0.5)
    bound = Bound(layer, (50,))
    ctx = bound.ctx()
    m1 = layer.mask((4, 50), ctx, np.float64)
    assert np.array_equal(m1, layer.mask((4, 50), bound.ctx(), np.float64))
    for change in ({"step": 6}, {"shard": 3}, {"seed": 4}):
        other = bound.ctx()
        for k, v in change.items():
            setattr(other, k, v)
        assert not np.array_equal(m1, layer.mask((4, 50), other, np.float64)), change
    assert set(np.unique(m1)) == {0.0, 2.0}
    y, _ = layer.forward(np.ones((4, 50)), {}, bound.ctx(training=False))
    assert np.array_equal(y, np.ones((4, 50)))  # evaluation: identity


def test_softmax_cross_entropy_gradient_and_counts():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((6, 4)) * 3
    y = rng.integers(0, 4, 6)
    loss, correct, grad = softmax_cross_entropy(logits, y)
    p = np.exp(logits) / np.exp(logits).sum(axis=1, keepdims=True)
    assert loss == pytest.approx(-np.log(p[np.arange(6), y]).sum(), rel=1e-12)
    assert correct == int((logits.argmax(axis=1) == y).sum())
    idx = np.arange(logits.size)
    num = numeric_grad(lambda: softmax_cross_entropy(logits, y)[0], logits, idx)
    np.testing.assert_allclose(grad.reshape(-1), num, rtol=1e-6, atol=1e-8)
    big, _, _ = softmax_cross_entropy(np.array([[1000.0, 0.0]]), np.array([1]))
    assert big == pytest.approx(1000.0)  # stable for large logits


@pytest.mark.parametrize("case", ["conv 3x3", "conv 3x3 stride 2", "depthwise 3x3",
                                  "depthwise 3x3 stride 2"])
def test_cache_sized_chunks_change_nothing_but_speed(case, monkeypatch):
    make, shape = CASES[case]
    bound = Bound(make(), shape)
    x = _input(shape, n=5)
    r = np.random.default_rng(2).standard_normal((5, *bound.out_shape))
    whole = _numpy_loss_and_grads(bound, x, r)
    monkeypatch.setattr("engine.conv.CHUNK_FLOATS", 1)  # one image per chunk
    split = _numpy_loss_and_grads(bound, x, r)
    assert split[0] == pytest.approx(whole[0], rel=1e-12)
    np.testing.assert_allclose(split[1], whole[1], rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(split[2], whole[2], rtol=1e-12, atol=1e-12)
