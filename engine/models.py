"""The architectures, sized from the dataset's input shape (C, H, W) and class count."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.base import Layer
from engine.conv import Conv2d, DepthwiseConv2d
from engine.graph import Model, Residual, Sequential, plan_layout
from engine.layers import Dense, Dropout, Flatten, GlobalAvgPool, MaxPool, ReLU, ReLU6
from engine.norm import BatchNorm

ARCHS = ("logreg", "mlp", "cnn", "mobilenet_v1", "resnet")

# MobileNet v1's 13 depthwise-separable blocks: (output channels, stride at full resolution)
_MOBILENET_BLOCKS = [(64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2), (512, 1),
                     (512, 1), (512, 1), (512, 1), (512, 1), (1024, 2), (1024, 1)]


def _ch(c: int, width: float) -> int:
    return max(1, int(round(c * width)))


def _logreg(shape, k, o) -> list[Layer]:
    return [Flatten(), Dense(k, "fc", init="glorot")]


def _mlp(shape, k, o) -> list[Layer]:
    layers: list[Layer] = [Flatten(), Dense(int(o.get("hidden", 128)), "fc1"), ReLU()]
    if o.get("dropout", 0.0):
        layers.append(Dropout(float(o["dropout"])))
    return layers + [Dense(k, "fc2", init="glorot")]


def _cnn(shape, k, o) -> list[Layer]:
    """LeNet-like: two conv+ReLU+pool stages, a hidden dense layer, the classifier."""
    w = float(o.get("width", 1.0))
    c, h, _ = shape
    layers: list[Layer] = []
    for i, ch in enumerate((32, 64), start=1):
        layers += [Conv2d(_ch(ch, w), 3, f"conv{i}"), ReLU()]
        if h >= 2:
            layers.append(MaxPool(2))
            h //= 2
    layers += [Flatten(), Dense(_ch(128, w), "fc1"), ReLU()]
    if o.get("dropout", 0.0):
        layers.append(Dropout(float(o["dropout"])))
    return layers + [Dense(k, "fc2", init="glorot")]


def _mobilenet_v1(shape, k, o) -> list[Layer]:
    """MobileNet v1; a stride 2 is kept only while the feature map stays >= 2x2, so small
    inputs (8x8, 32x32) keep spatial extent and 224x224 gets the original strides."""
    w = float(o.get("width", 1.0))
    _, h, _ = shape
    s0 = 2 if h >= 64 else 1
    h = (h - 1) // s0 + 1
    layers: list[Layer] = [Conv2d(_ch(32, w), 3, "conv0", stride=s0, bias=False),
                           BatchNorm("bn0"), ReLU6()]
    for i, (ch, s) in enumerate(_MOBILENET_BLOCKS, start=1):
        s = s if h >= 4 else 1
        h = (h - 1) // s + 1
        layers += [DepthwiseConv2d(3, f"block{i}.dw", stride=s), BatchNorm(f"block{i}.bn_dw"),
                   ReLU6(), Conv2d(_ch(ch, w), 1, f"block{i}.pw", pad=0, bias=False),
                   BatchNorm(f"block{i}.bn_pw"), ReLU6()]
    return layers + [GlobalAvgPool(), Dense(k, "fc", init="glorot")]


def _basic_block(name: str, cin: int, cout: int, stride: int) -> list[Layer]:
    body: list[Layer] = [Conv2d(cout, 3, f"{name}.conv1", stride=stride, bias=False),
                         BatchNorm(f"{name}.bn1"), ReLU(),
                         Conv2d(cout, 3, f"{name}.conv2", bias=False), BatchNorm(f"{name}.bn2")]
    short: list[Layer] = []
    if stride != 1 or cin != cout:
        short = [Conv2d(cout, 1, f"{name}.down", stride=stride, pad=0, bias=False),
                 BatchNorm(f"{name}.down_bn")]
    return [Residual(body, short), ReLU()]


def _resnet(shape, k, o) -> list[Layer]:
    """A small CIFAR-style ResNet: a stem and three stages of basic blocks (16, 32, 64 x width)."""
    w = float(o.get("width", 1.0))
    blocks = int(o.get("blocks", 1))
    _, h, _ = shape
    cin = _ch(16, w)
    layers: list[Layer] = [Conv2d(cin, 3, "stem", bias=False), BatchNorm("stem_bn"), ReLU()]
    for stage, ch in enumerate((16, 32, 64), start=1):
        cout = _ch(ch, w)
        for j in range(blocks):
            stride = 2 if (stage > 1 and j == 0 and h >= 4) else 1
            h = (h - 1) // stride + 1
            layers += _basic_block(f"layer{stage}.{j}", cin, cout, stride)
            cin = cout
    return layers + [GlobalAvgPool(), Dense(k, "fc", init="glorot")]


_BUILDERS: dict[str, Callable[..., list[Layer]]] = {
    "logreg": _logreg, "mlp": _mlp, "cnn": _cnn, "mobilenet_v1": _mobilenet_v1,
    "resnet": _resnet,
}


def _network(arch: str, input_shape: tuple[int, ...], num_classes: int,
             options: dict[str, Any] | None) -> Sequential:
    if arch not in _BUILDERS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    if len(input_shape) != 3:
        raise ValueError(f"input_shape must be (C, H, W), got {tuple(input_shape)}")
    return Sequential(_BUILDERS[arch](tuple(input_shape), int(num_classes), dict(options or {})))


def build_model(arch: str, input_shape: tuple[int, int, int], num_classes: int,
                options: dict[str, Any] | None = None) -> Model:
    """The network for `arch` on inputs of shape (C, H, W) with `num_classes` outputs."""
    net = _network(arch, input_shape, num_classes, options)
    return Model(arch, tuple(int(d) for d in input_shape), int(num_classes), net)


def parameter_count(arch: str, input_shape: tuple[int, ...], num_classes: int,
                    options: dict[str, Any] | None = None) -> int:
    """How many parameters `build_model` would make, without allocating them: ValueError for
    a network that cannot be built, ModelTooLarge past MAX_PARAMS."""
    net = _network(arch, input_shape, num_classes, options)
    shape = tuple(int(d) for d in input_shape)
    return sum(s.size for s in plan_layout(arch, shape, int(num_classes), net).params)
