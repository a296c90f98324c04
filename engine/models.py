"""The built-in architectures, written as layer graphs (engine.layerspec) sized from the
dataset's input shape (C, H, W) and class count; a job's own `model.layers` takes the same path.

`resnet18`, `resnet50` and `mobilenet_v2` are torchvision's (standard strides and blocks at any
input size: 224x224 with 1000 classes gives the published parameter counts); `mobilenet_v1` and
the CIFAR-style `resnet` keep a stride only while the feature map stays >= 2x2, so 8x8 and
32x32 inputs keep spatial extent.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from engine.base import Slot
from engine.graph import Model, Sequential, plan_layout
from engine.layerspec import LayerInfo, network

ARCHS = ("logreg", "mlp", "cnn", "mobilenet_v1", "resnet", "resnet18", "resnet50",
         "mobilenet_v2")
CUSTOM = "custom"  # the arch of a job that brings its own `model.layers`

# MobileNet v1's 13 depthwise-separable blocks: (output channels, stride at full resolution)
_MOBILENET_BLOCKS = [(64, 1), (128, 2), (128, 1), (256, 2), (256, 1), (512, 2), (512, 1),
                     (512, 1), (512, 1), (512, 1), (512, 1), (1024, 2), (1024, 1)]
# MobileNet v2's inverted residual stages: (expansion t, channels c, repeats n, first stride s)
_MOBILENET_V2_STAGES = [(1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2),
                        (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1)]

Graph = list[dict[str, Any]]


def _ch(c: int, width: float) -> int:
    return max(1, int(round(c * width)))


def _divisible(c: float, divisor: int = 8) -> int:
    """torchvision's _make_divisible: channels rounded to a multiple of 8, never 10% below."""
    out = max(divisor, int(c + divisor / 2) // divisor * divisor)
    return out + divisor if out < 0.9 * c else out


def _conv(out: int, k: int, name: str, stride: int = 1, padding: int | None = None,
          bias: bool = True) -> dict[str, Any]:
    layer = {"type": "conv2d", "out_channels": out, "kernel": k, "stride": stride, "bias": bias,
             "name": name}
    return layer if padding is None else {**layer, "padding": padding}


def _dw(name: str, stride: int = 1) -> dict[str, Any]:
    return {"type": "depthwise_conv2d", "kernel": 3, "stride": stride, "name": name}


def _bn(name: str) -> dict[str, Any]:
    return {"type": "batchnorm", "name": name}


def _dense(units: int, name: str) -> dict[str, Any]:
    return {"type": "dense", "units": units, "name": name}


def _dropout(o: dict[str, Any]) -> Graph:
    return [{"type": "dropout", "rate": float(o["dropout"])}] if o.get("dropout") else []


RELU, RELU6, FLATTEN, GAP = ({"type": "relu"}, {"type": "relu6"}, {"type": "flatten"},
                             {"type": "global_avgpool"})


def _logreg(shape, k, o) -> Graph:
    return [FLATTEN, _dense(k, "fc")]


def _mlp(shape, k, o) -> Graph:
    return [FLATTEN, _dense(int(o.get("hidden", 128)), "fc1"), RELU, *_dropout(o),
            _dense(k, "fc2")]


def _cnn(shape, k, o) -> Graph:
    """LeNet-like: two conv+ReLU+pool stages, a hidden dense layer, the classifier."""
    w = float(o.get("width", 1.0))
    h = shape[1]
    layers: Graph = []
    for i, ch in enumerate((32, 64), start=1):
        layers += [_conv(_ch(ch, w), 3, f"conv{i}"), RELU]
        if h >= 2:
            layers.append({"type": "maxpool", "kernel": 2})
            h //= 2
    return layers + [FLATTEN, _dense(_ch(128, w), "fc1"), RELU, *_dropout(o), _dense(k, "fc2")]


def _mobilenet_v1(shape, k, o) -> Graph:
    """MobileNet v1 (batch norm after every conv, ReLU6)."""
    w = float(o.get("width", 1.0))
    h = shape[1]
    s0 = 2 if h >= 64 else 1
    h = (h - 1) // s0 + 1
    layers: Graph = [_conv(_ch(32, w), 3, "conv0", stride=s0, bias=False), _bn("bn0"), RELU6]
    for i, (ch, s) in enumerate(_MOBILENET_BLOCKS, start=1):
        s = s if h >= 4 else 1
        h = (h - 1) // s + 1
        layers += [_dw(f"block{i}.dw", s), _bn(f"block{i}.bn_dw"), RELU6,
                   _conv(_ch(ch, w), 1, f"block{i}.pw", padding=0, bias=False),
                   _bn(f"block{i}.bn_pw"), RELU6]
    return layers + [GAP, *_dropout(o), _dense(k, "fc")]


def _basic_block(name: str, cin: int, cout: int, stride: int,
                 short_names: tuple[str, str] = ("down", "down_bn")) -> Graph:
    body = [_conv(cout, 3, f"{name}.conv1", stride=stride, bias=False), _bn(f"{name}.bn1"), RELU,
            _conv(cout, 3, f"{name}.conv2", bias=False), _bn(f"{name}.bn2")]
    short: Graph = []
    if stride != 1 or cin != cout:
        short = [_conv(cout, 1, f"{name}.{short_names[0]}", stride=stride, padding=0,
                       bias=False), _bn(f"{name}.{short_names[1]}")]
    return [{"type": "residual", "layers": body, "shortcut": short}, RELU]


def _bottleneck(name: str, cin: int, planes: int, stride: int) -> Graph:
    """torchvision's Bottleneck (ResNet v1.5: the stride sits on the 3x3 conv)."""
    cout = planes * 4
    body = [_conv(planes, 1, f"{name}.conv1", padding=0, bias=False), _bn(f"{name}.bn1"), RELU,
            _conv(planes, 3, f"{name}.conv2", stride=stride, bias=False), _bn(f"{name}.bn2"),
            RELU, _conv(cout, 1, f"{name}.conv3", padding=0, bias=False), _bn(f"{name}.bn3")]
    short: Graph = []
    if stride != 1 or cin != cout:
        short = [_conv(cout, 1, f"{name}.downsample.0", stride=stride, padding=0, bias=False),
                 _bn(f"{name}.downsample.1")]
    return [{"type": "residual", "layers": body, "shortcut": short}, RELU]


def _resnet(shape, k, o) -> Graph:
    """A small CIFAR-style ResNet: a stem and three stages of basic blocks (16, 32, 64 x width)."""
    w = float(o.get("width", 1.0))
    blocks = int(o.get("blocks", 1))
    h = shape[1]
    cin = _ch(16, w)
    layers: Graph = [_conv(cin, 3, "stem", bias=False), _bn("stem_bn"), RELU]
    for stage, ch in enumerate((16, 32, 64), start=1):
        cout = _ch(ch, w)
        for j in range(blocks):
            stride = 2 if (stage > 1 and j == 0 and h >= 4) else 1
            h = (h - 1) // stride + 1
            layers += _basic_block(f"layer{stage}.{j}", cin, cout, stride)
            cin = cout
    return layers + [GAP, *_dropout(o), _dense(k, "fc")]


def _imagenet_resnet(blocks: tuple[int, ...], bottleneck: bool) -> Callable[..., Graph]:
    def build(shape, k, o) -> Graph:
        w = float(o.get("width", 1.0))
        cin = _ch(64, w)
        layers: Graph = [_conv(cin, 7, "conv1", stride=2, padding=3, bias=False), _bn("bn1"),
                         RELU, {"type": "maxpool", "kernel": 3, "stride": 2, "padding": 1}]
        for stage, (n, ch) in enumerate(zip(blocks, (64, 128, 256, 512)), start=1):
            planes = _ch(ch, w)
            for j in range(n):
                stride = 2 if stage > 1 and j == 0 else 1
                name = f"layer{stage}.{j}"
                if bottleneck:
                    layers += _bottleneck(name, cin, planes, stride)
                    cin = planes * 4
                else:
                    layers += _basic_block(name, cin, planes, stride,
                                           ("downsample.0", "downsample.1"))
                    cin = planes
        return layers + [GAP, *_dropout(o), _dense(k, "fc")]

    return build


def _mobilenet_v2(shape, k, o) -> Graph:
    """torchvision's MobileNet v2: inverted residual blocks, a 1280-channel last conv."""
    w = float(o.get("width", 1.0))
    cin = _divisible(32 * w)
    layers: Graph = [_conv(cin, 3, "features.0.0", stride=2, bias=False), _bn("features.0.1"),
                     RELU6]
    index = 1
    for t, c, n, s in _MOBILENET_V2_STAGES:
        cout = _divisible(c * w)
        for j in range(n):
            stride = s if j == 0 else 1
            name, hidden = f"features.{index}.conv", int(round(cin * t))
            body: Graph = []
            if t != 1:
                body += [_conv(hidden, 1, f"{name}.0.0", padding=0, bias=False),
                         _bn(f"{name}.0.1"), RELU6]
            at = len(body) // 3  # torchvision numbers the dw conv after the expansion
            body += [_dw(f"{name}.{at}.0", stride), _bn(f"{name}.{at}.1"), RELU6,
                     _conv(cout, 1, f"{name}.{at + 1}", padding=0, bias=False),
                     _bn(f"{name}.{at + 2}")]
            if stride == 1 and cin == cout:
                layers.append({"type": "residual", "layers": body})
            else:
                layers += body
            cin, index = cout, index + 1
    last = _divisible(1280 * max(w, 1.0))
    return layers + [_conv(last, 1, f"features.{index}.0", padding=0, bias=False),
                     _bn(f"features.{index}.1"), RELU6, GAP, *_dropout(o),
                     _dense(k, "classifier.1")]


_BUILDERS: dict[str, Callable[..., Graph]] = {
    "logreg": _logreg, "mlp": _mlp, "cnn": _cnn, "mobilenet_v1": _mobilenet_v1,
    "resnet": _resnet, "resnet18": _imagenet_resnet((2, 2, 2, 2), bottleneck=False),
    "resnet50": _imagenet_resnet((3, 4, 6, 3), bottleneck=True), "mobilenet_v2": _mobilenet_v2,
}


def graph(arch: str, input_shape: tuple[int, ...], num_classes: int,
          options: dict[str, Any] | None = None) -> Graph:
    """The layer graph of a job's model: its own `layers` for `custom`, else the built-in's."""
    o = dict(options or {})
    if arch == CUSTOM:
        if not o.get("layers"):
            raise ValueError("model.layers is required when model.arch is 'custom'")
        return o["layers"]
    if arch not in _BUILDERS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)} or give "
                         f"model.layers")
    if o.get("layers"):
        raise ValueError(f"give either model.arch ({arch!r}) or model.layers, not both")
    return _BUILDERS[arch](tuple(input_shape), int(num_classes), o)


def _network(arch: str, input_shape: tuple[int, ...], num_classes: int,
             options: dict[str, Any] | None) -> tuple[Sequential, list[LayerInfo]]:
    if len(input_shape) != 3:
        raise ValueError(f"input_shape must be (C, H, W), got {tuple(input_shape)}")
    return network(graph(arch, input_shape, num_classes, options), tuple(input_shape),
                   int(num_classes))


def build_model(arch: str, input_shape: tuple[int, int, int], num_classes: int,
                options: dict[str, Any] | None = None) -> Model:
    """The network for `arch` on inputs of shape (C, H, W) with `num_classes` outputs."""
    net, _ = _network(arch, input_shape, num_classes, options)
    return Model(arch, tuple(int(d) for d in input_shape), int(num_classes), net)


def parameter_count(arch: str, input_shape: tuple[int, ...], num_classes: int,
                    options: dict[str, Any] | None = None) -> int:
    """How many parameters `build_model` would make, without allocating them: ValueError for
    a network that cannot be built, ModelTooLarge past MAX_PARAMS."""
    return sum(s.size for s in parameter_slots(arch, input_shape, num_classes, options))


def parameter_slots(arch: str, input_shape: tuple[int, ...], num_classes: int,
                    options: dict[str, Any] | None = None) -> list[Slot]:
    """The parameter tensors `build_model` would lay out, without allocating them."""
    net, _ = _network(arch, input_shape, num_classes, options)
    shape = tuple(int(d) for d in input_shape)
    return list(plan_layout(arch, shape, int(num_classes), net).params)


def layer_infos(arch: str, input_shape: tuple[int, ...], num_classes: int,
                options: dict[str, Any] | None = None) -> list[LayerInfo]:
    """Each layer's output shape, parameters and multiply-adds per sample (for the plan)."""
    return _network(arch, input_shape, num_classes, options)[1]
