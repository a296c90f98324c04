"""A model as data: a list of layer objects (docs/models.md), validated and built in one walk.

Every model, built-in or the user's own, is such a list: `engine.models` writes the built-in
architectures in this format, so one code path builds, checks and costs them all. The walk
builds each layer on a scratch builder to learn its output shape, so a bad graph is refused
naming the layer (`model.layers[4].layers[1] (conv2d): ...`) before anything is allocated, and
it records what the plan needs (parameters, multiply-adds and activations per sample).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from engine.base import Builder, Layer
from engine.conv import Conv2d, DepthwiseConv2d
from engine.graph import MAX_PARAMS, Residual, Sequential
from engine.layers import (
    AvgPool,
    Dense,
    Dropout,
    Flatten,
    GlobalAvgPool,
    MaxPool,
    ReLU,
    ReLU6,
)
from engine.norm import BatchNorm

MAX_LAYERS = 2000  # every layer object, nested ones included (resnet50 has 228)
MAX_DEPTH = 8  # residual blocks inside residual blocks
MAX_INT = 2**31 - 1  # any size option; how big a model may be is MAX_PARAMS's to say
# elements of one layer's output for one sample (256 MiB of float32; resnet50 at 224x224 has
# 802,816): sizes are Python integers, checked before anything is allocated or admitted
MAX_ACTIVATION = 2**26


class LayerError(ValueError):
    """A layer graph that cannot be built; the message names the layer and the problem."""


@dataclass(frozen=True)
class LayerInfo:
    """One layer of a built graph, as the plan reports it (per sample)."""

    path: str  # model.layers[4].layers[1]
    type: str
    out_shape: tuple[int, ...]
    params: int
    macs: int  # multiply-adds of the forward pass
    activations: int  # elements of its output


# type -> option -> (kind, default); kind: "int" (>= 1), "int0" (>= 0), "bool", "rate",
# "init", "name", "layers". A default of None means the option is required.
_Options = dict[str, tuple[str, Any]]
_NAME: _Options = {"name": ("name", "")}
_WINDOW: _Options = {"kernel": ("int", 2), "stride": ("int", 0), "padding": ("int0", 0), **_NAME}
OPTIONS: dict[str, _Options] = {
    "conv2d": {"out_channels": ("int", None), "kernel": ("int", 3), "stride": ("int", 1),
               "padding": ("int0", -1), "bias": ("bool", True), **_NAME},
    "depthwise_conv2d": {"kernel": ("int", 3), "stride": ("int", 1), "padding": ("int0", -1),
                         **_NAME},
    "dense": {"units": ("int", None), "init": ("init", ""), **_NAME},
    "batchnorm": dict(_NAME),
    "relu": dict(_NAME),
    "relu6": dict(_NAME),
    "maxpool": dict(_WINDOW),
    "avgpool": dict(_WINDOW),
    "global_avgpool": dict(_NAME),
    "flatten": dict(_NAME),
    "dropout": {"rate": ("rate", None), **_NAME},
    "residual": {"layers": ("layers", None), "shortcut": ("layers", []), **_NAME},
}
LAYER_TYPES = tuple(OPTIONS)
INITS = ("he", "glorot")


def network(layers: Any, input_shape: tuple[int, ...], num_classes: int,
            where: str = "model.layers") -> tuple[Sequential, list[LayerInfo]]:
    """The network `layers` describes, on inputs of `input_shape`, ending in `num_classes`
    logits; LayerError naming the layer when it cannot be built."""
    walk = _Walk()
    net, out, _ = walk.sequence(layers, tuple(int(d) for d in input_shape), where, "layers.", top=True)
    if out != (num_classes,):
        raise LayerError(f"{where}: the last layer gives shape {out}, but the dataset has "
                         f"{num_classes} classes: end with a dense layer of {num_classes} units")
    return net, walk.infos


class _Walk:
    def __init__(self) -> None:
        self.infos: list[LayerInfo] = []
        self.count = 0
        self.scratch = Builder()
        self.names: dict[str, str] = {}  # layer name -> where it was given (names key weights)

    def sequence(self, layers: Any, shape: tuple[int, ...], where: str, prefix: str,
                 top: bool = False, depth: int = 0) -> tuple[Sequential, tuple[int, ...], int]:
        if not isinstance(layers, list) or (top and not layers):
            raise LayerError(f"{where} must be a non-empty list of layer objects" if top
                             else f"{where} must be a list of layer objects")
        if depth > MAX_DEPTH:
            raise LayerError(f"{where}: residual blocks nest deeper than {MAX_DEPTH}")
        built: list[Layer] = []
        macs = 0
        for i, spec in enumerate(layers):
            last = top and i == len(layers) - 1
            layer, shape, m = self.one(spec, shape, f"{where}[{i}]", f"{prefix}{i}", last, depth)
            built.append(layer)
            macs += m
        return Sequential(built), shape, macs

    def one(self, spec: Any, shape: tuple[int, ...], where: str, path: str, last: bool,
            depth: int) -> tuple[Layer, tuple[int, ...], int]:
        self.count += 1
        if self.count > MAX_LAYERS:
            raise LayerError(f"{where}: more than {MAX_LAYERS} layers")
        if not isinstance(spec, dict):
            raise LayerError(f"{where} must be an object with a 'type'")
        kind = spec.get("type")
        if kind not in OPTIONS:
            raise LayerError(f"{where}: unknown layer type {kind!r}; one of "
                             f"{', '.join(LAYER_TYPES)}")
        loc, where = where, f"{where} ({kind})"
        o = _options(spec, kind, where)
        name = o["name"] or path
        if name in self.names:
            raise LayerError(f"{where}: the name {name!r} is taken by {self.names[name]}: "
                             f"every layer needs its own (it names the layer's weights)")
        self.names[name] = loc
        if kind == "residual":
            return self.residual(o, shape, loc, name, depth)
        layer = _MAKERS[kind](o, name, last)
        _check_input(kind, shape, o, where)
        before = len(self.scratch.params)
        out = layer.build(shape, self.scratch)
        params = sum(s.size for s in self.scratch.params[before:])
        # (a layer past MAX_PARAMS is refused by the model's count, which names the total)
        if math.prod(out) > MAX_ACTIVATION and params <= MAX_PARAMS:
            raise LayerError(f"{where}: its output {out} has {math.prod(out):,} elements per "
                             f"sample; at most {MAX_ACTIVATION:,}")
        macs = _macs(kind, shape, out, o)
        self.infos.append(LayerInfo(loc, kind, out, params, macs, math.prod(out)))
        return layer, out, macs

    def residual(self, o: dict[str, Any], shape: tuple[int, ...], loc: str, name: str,
                 depth: int) -> tuple[Layer, tuple[int, ...], int]:
        where = f"{loc} (residual)"
        if not o["layers"]:
            raise LayerError(f"{where}: 'layers' must hold at least one layer")
        body, out, m1 = self.sequence(o["layers"], shape, f"{loc}.layers", f"{name}.body.",
                                      depth=depth + 1)
        short, out_s, m2 = self.sequence(o["shortcut"], shape, f"{loc}.shortcut",
                                         f"{name}.shortcut.", depth=depth + 1)
        if out != out_s:
            what = "the shortcut gives" if o["shortcut"] else "its input (the identity) is"
            raise LayerError(f"{where}: the body gives shape {out} but {what} {out_s}: add a "
                             f"'shortcut' projection (e.g. a 1x1 conv2d with the same stride)")
        block = Residual(body.layers, short.layers)
        self.infos.append(LayerInfo(loc, "residual", out, 0, math.prod(out),
                                    math.prod(out)))
        return block, out, m1 + m2 + math.prod(out)


def _options(spec: dict[str, Any], kind: str, where: str) -> dict[str, Any]:
    known = OPTIONS[kind]
    unknown = sorted(set(spec) - set(known) - {"type"})
    if unknown:
        raise LayerError(f"{where}: unknown option {unknown[0]!r}; options: "
                         f"{', '.join(known) or 'none'}")
    out: dict[str, Any] = {}
    for key, (check, default) in known.items():
        if key not in spec:
            if default is None:
                raise LayerError(f"{where}: {key!r} is required")
            out[key] = default
            continue
        out[key] = _value(spec[key], check, f"{where}: {key}")
    return out


def _value(value: Any, check: str, what: str) -> Any:
    if check in ("int", "int0"):
        low = 1 if check == "int" else 0
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= MAX_INT:
            raise LayerError(f"{what} must be an integer >= {low}, got {value!r}")
    elif check == "bool" and not isinstance(value, bool):
        raise LayerError(f"{what} must be true or false, got {value!r}")
    elif check == "rate" and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not 0 <= value < 1):
        raise LayerError(f"{what} must be a number in [0, 1), got {value!r}")
    elif check == "init" and value not in INITS:
        raise LayerError(f"{what} must be one of {', '.join(INITS)}, got {value!r}")
    elif check == "name" and (not isinstance(value, str) or not 0 < len(value) <= 100):
        raise LayerError(f"{what} must be a string of 1 to 100 characters")
    elif check == "layers" and not isinstance(value, list):
        raise LayerError(f"{what} must be a list of layer objects")
    return value


_SPATIAL = ("conv2d", "depthwise_conv2d", "maxpool", "avgpool", "global_avgpool")


def _check_input(kind: str, shape: tuple[int, ...], o: dict[str, Any], where: str) -> None:
    """What a layer needs of its input, said before its build would fail obscurely."""
    if kind in _SPATIAL and len(shape) != 3:
        raise LayerError(f"{where}: needs feature maps (C, H, W), got shape {shape}")
    if kind == "dense" and len(shape) != 1:
        raise LayerError(f"{where}: needs a flat input, got shape {shape}: put a flatten or "
                         f"global_avgpool before it")
    if kind in ("conv2d", "depthwise_conv2d", "maxpool", "avgpool"):
        k, pad = o["kernel"], _padding(o)
        h, w = shape[1] + 2 * pad, shape[2] + 2 * pad
        if k > min(h, w):
            raise LayerError(f"{where}: a {k}x{k} window does not fit the {shape[1]}x{shape[2]} "
                             f"input padded by {pad}")
        if kind in ("maxpool", "avgpool") and 2 * pad > k:
            raise LayerError(f"{where}: padding {pad} must be at most half the kernel ({k})")


def _padding(o: dict[str, Any]) -> int:
    """conv: 'same'-style k // 2 unless given; pools: 0 unless given."""
    return o["kernel"] // 2 if o.get("padding", 0) < 0 else o["padding"]


def _macs(kind: str, shape: tuple[int, ...], out: tuple[int, ...], o: dict[str, Any]) -> int:
    if kind == "conv2d":
        return math.prod(out) * shape[0] * o["kernel"] ** 2
    if kind == "depthwise_conv2d":
        return math.prod(out) * o["kernel"] ** 2
    if kind == "dense":
        return shape[0] * out[0]
    if kind in ("maxpool", "avgpool"):
        return math.prod(out) * o["kernel"] ** 2
    return math.prod(shape)  # element-wise layers: one operation per input element


_Maker = Callable[[dict[str, Any], str, bool], Layer]
_MAKERS: dict[str, _Maker] = {
    "conv2d": lambda o, n, last: Conv2d(o["out_channels"], o["kernel"], n, stride=o["stride"],
                                        pad=_padding(o), bias=o["bias"]),
    "depthwise_conv2d": lambda o, n, last: DepthwiseConv2d(
        o["kernel"], n, stride=o["stride"], pad=_padding(o)),
    # the classifier (the graph's last layer) starts Glorot-uniform, hidden layers He-normal
    "dense": lambda o, n, last: Dense(o["units"], n,
                                      init=o["init"] or ("glorot" if last else "he")),
    "batchnorm": lambda o, n, last: BatchNorm(n),
    "relu": lambda o, n, last: ReLU(),
    "relu6": lambda o, n, last: ReLU6(),
    "maxpool": lambda o, n, last: MaxPool(o["kernel"], o["stride"] or o["kernel"], o["padding"]),
    "avgpool": lambda o, n, last: AvgPool(o["kernel"], o["stride"] or o["kernel"], o["padding"]),
    "global_avgpool": lambda o, n, last: GlobalAvgPool(),
    "flatten": lambda o, n, last: Flatten(),
    "dropout": lambda o, n, last: Dropout(float(o["rate"])),
}
