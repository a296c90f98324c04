"""An ONNX graph as `model.layers` (docs/models.md): a PyTorch model comes in through
`torch.onnx.export`, or any other tool that writes ONNX.

The graph is read from its one input down the chain of nodes. A tensor that feeds two nodes
opens a residual block: both branches are read until they meet, and they must meet at an Add
(`body(x) + shortcut(x)`; a branch that is the tensor itself is the identity shortcut). Each
operator becomes one layer (Conv, Gemm, MatMul with its bias Add, Relu, Clip to [0, 6],
BatchNormalization, MaxPool, AveragePool, GlobalAveragePool or a ReduceMean over H and W,
Flatten or a Reshape to (N, features), Dropout) or none (Identity, and a Flatten after global
pooling, which already gives (C,)). Any other operator, or a supported one with options the
layers cannot express (dilation, asymmetric padding, groups other than depthwise), is refused
naming the operator and its node. Constants (initializers, Constant nodes) are weights.

Layers with weights are named after them (`layer1.0.conv1.weight` names `layer1.0.conv1`), so
the graph's weights keep their names under the engine's (`Imported.arrays`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from phalanx.modelio import need

SUPPORTED = ("Conv", "Gemm", "MatMul", "Relu", "Clip", "BatchNormalization", "MaxPool",
             "AveragePool", "GlobalAveragePool", "ReduceMean", "Flatten", "Reshape", "Add",
             "Dropout", "Identity", "Constant")
MAX_NAME = 100  # a layer name's limit (engine.layerspec)

# what a tensor holds, as the layers see it: feature maps (N, C, H, W); the (N, C, 1, 1) of a
# global pooling, which model.layers' global_avgpool already gives flat; or (N, F)
SPATIAL, POOLED, FLAT = "spatial", "pooled", "flat"


class ImportRefused(ValueError):
    """The graph holds something model.layers cannot express; the message names the node."""


@dataclass(frozen=True)
class Imported:
    """The layer graph, what the ONNX graph says of its input (C, H, W) and classes (None
    where its dimensions are symbolic), and its weights under the layers' names."""

    layers: list[dict[str, Any]]
    input_shape: tuple[int, int, int] | None
    num_classes: int | None
    arrays: dict[str, np.ndarray] = field(default_factory=dict)


def read_onnx(path: Path, weights: bool = False) -> Any:
    """The ModelProto in `path` (protobuf: nothing in it runs). Weights kept in external files
    are read only when asked for: the layers need their shapes alone."""
    onnx = need("onnx")
    try:
        return onnx.load(str(path), load_external_data=weights)
    except OSError as exc:
        raise ImportRefused(f"cannot read {path}: {exc.strerror or exc}") from None
    except Exception as exc:  # protobuf's DecodeError and kin: not an ONNX file
        raise ImportRefused(f"{path} is not an ONNX model: {exc}") from None


def import_onnx(model: Any, weights: bool = False) -> Imported:
    """`model` (an onnx ModelProto) as model.layers; ImportRefused naming what is not
    supported. `weights`: also collect the weights by layer name (`Imported.arrays`)."""
    g = _Graph(model, weights)
    layers, end, _ = g.chain(g.input, SPATIAL)
    if end != g.output:
        raise ImportRefused(f"the graph's output {g.output!r} is not the end of its chain of "
                            f"layers ({end!r})")
    if not layers:
        raise ImportRefused("the graph has no layers")
    _clear_positional_names(layers, g)
    return Imported(layers, g.input_shape(), g.num_classes(), g.arrays)


def _clear_positional_names(layers: list[dict[str, Any]], g: _Graph) -> None:
    """The engine names an unnamed layer by its place (`layers.3`, `layers.3.body.0`): a
    weight-derived name that is another layer's place (a torch attribute called `layers`)
    gets a suffix, or the engine would refuse the graph for the duplicate."""
    places = _places(layers, "layers.")
    g.names |= places
    for layer in _walk(layers):
        if layer.get("name") in places:
            layer["name"] = g.rename(layer["name"])


def _places(layers: list[dict[str, Any]], prefix: str) -> set[str]:
    """The names the engine gives the unnamed layers of `layers`, nested ones included."""
    out: set[str] = set()
    for i, layer in enumerate(layers):
        name = layer.get("name") or f"{prefix}{i}"
        if "name" not in layer:
            out.add(name)
        if layer["type"] == "residual":
            out |= _places(layer["layers"], f"{name}.body.")
            out |= _places(layer.get("shortcut", []), f"{name}.shortcut.")
    return out


def _walk(layers: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for layer in layers:
        out.append(layer)
        if layer["type"] == "residual":
            out += _walk(layer["layers"]) + _walk(layer.get("shortcut", []))
    return out


def _attrs(node: Any) -> dict[str, Any]:
    from onnx import helper

    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _where(node: Any) -> str:
    return f"{node.op_type} node {node.name or node.output[0]!r}"


class _Graph:
    """The graph's nodes indexed for the walk: which nodes compute from the input (dynamic),
    which tensors are constants, and who consumes each dynamic tensor."""

    def __init__(self, model: Any, weights: bool) -> None:
        gp = model.graph
        self.weights = weights
        self.consts: dict[str, Any] = {t.name: t for t in gp.initializer}
        inputs = [i for i in gp.input if i.name not in self.consts]
        if len(inputs) != 1 or len(gp.output) != 1:
            raise ImportRefused(f"the graph has {len(inputs)} inputs and {len(gp.output)} "
                                f"outputs; model.layers has one of each (images in, logits out)")
        self.input_info, self.output_info = inputs[0], gp.output[0]
        self.input, self.output = inputs[0].name, gp.output[0].name
        self.nodes = list(gp.node)
        self.index = {id(n): i for i, n in enumerate(self.nodes)}
        self.users: dict[str, list[Any]] = {}
        self._index_dynamic()
        self.arrays: dict[str, np.ndarray] = {}
        self.names: set[str] = set()

    def _index_dynamic(self) -> None:
        """Nodes in topological order (ONNX's rule): a node with a computed input is a layer
        candidate, any other folds into a constant (Constant, Identity of a constant) or is
        refused."""
        dynamic = {self.input}
        for node in self.nodes:
            if any(i in dynamic for i in node.input if i):
                dynamic.update(o for o in node.output if o)
                for i in dict.fromkeys(i for i in node.input if i in dynamic):
                    self.users.setdefault(i, []).append(node)
            elif node.op_type == "Constant":
                self.consts[node.output[0]] = _constant(node)
            elif node.op_type == "Identity" and node.input[0] in self.consts:
                self.consts[node.output[0]] = self.consts[node.input[0]]
            else:
                raise _refuse(node)

    # -- reading constants ------------------------------------------------------------------

    def const(self, node: Any, i: int, what: str) -> Any:
        """The TensorProto of the node's input i, which must be a constant."""
        name = node.input[i] if i < len(node.input) else ""
        if not name:
            raise ImportRefused(f"{_where(node)} has no {what}")
        if name not in self.consts:
            raise ImportRefused(f"{_where(node)}: its {what} ({name!r}) is computed, not a "
                                f"constant; model.layers holds weights as constants")
        return self.consts[name]

    def value(self, node: Any, i: int, what: str) -> np.ndarray:
        from onnx import numpy_helper

        return numpy_helper.to_array(self.const(node, i, what))

    def optional(self, node: Any, i: int) -> np.ndarray | None:
        if i >= len(node.input) or not node.input[i]:
            return None
        return self.value(node, i, "option")

    def keep(self, name: str, key: str, node: Any, i: int,
             how: Callable[[np.ndarray], np.ndarray] = np.asarray) -> None:
        """The weight in input i kept as `name.key` (only when weights are asked for)."""
        if self.weights:
            self.arrays[f"{name}.{key}"] = how(self.value(node, i, key)).astype(np.float32)

    def layer_name(self, node: Any, weight: str) -> str:
        """The layer after its weight (`conv1.weight` -> `conv1`), else after its node; unique,
        at most MAX_NAME characters."""
        base = weight.removesuffix(".weight") if weight.endswith(".weight") else ""
        base = base or node.name or f"{node.op_type}_{self.index[id(node)]}"
        base = base[-MAX_NAME + 8:] if len(base) > MAX_NAME else base
        name, n = base, 1
        while name in self.names:
            name, n = f"{base}_{n}", n + 1
        self.names.add(name)
        return name

    def rename(self, name: str) -> str:
        """`name` made unique again (its weights follow it)."""
        new, n = name, 1
        while new in self.names:
            new, n = f"{name}_{n}", n + 1
        self.names.add(new)
        for key in [k for k in self.arrays if k.rsplit(".", 1)[0] == name]:
            self.arrays[f"{new}.{key.rsplit('.', 1)[1]}"] = self.arrays.pop(key)
        return new

    # -- the walk ---------------------------------------------------------------------------

    def next_users(self, x: str) -> list[Any]:
        return [] if x == self.output else self.users.get(x, [])

    def chain(self, x: str, rank: str, join: Any = None) -> tuple[list[Any], str, str]:
        """Layers from tensor x on, until the graph's output or (in a branch) the join."""
        layers: list[Any] = []
        while True:
            users = self.next_users(x)
            for user in users:
                if user.op_type not in _CONVERTERS:
                    raise _refuse(user)
            if join is not None and len(users) == 1 and users[0] is join:
                return layers, x, rank
            if not users:
                if join is not None:
                    raise ImportRefused(f"a branch ends at {x!r} without reaching "
                                        f"{_where(join)}")
                return layers, x, rank
            if len(users) > 2:
                names = ", ".join(_where(u) for u in users)
                raise ImportRefused(f"tensor {x!r} feeds {len(users)} nodes ({names}); "
                                    f"model.layers branches in two, joined by an Add")
            if len(users) == 2:
                block, x, rank = self.residual(x, users, rank)
                layers.append(block)
                continue
            layer, x, rank = self.convert(users[0], x, rank)
            if layer is not None:
                layers.append(layer)

    def residual(self, x: str, users: list[Any], rank: str) -> tuple[dict[str, Any], str, str]:
        join = self.meeting(users)
        if join.op_type != "Add":
            raise ImportRefused(f"the branches from {x!r} meet at {_where(join)}; only an Add "
                                f"joins two branches (a residual block)")
        branches = []
        for user in users:
            if user is join:
                branches.append(([], x))
                continue
            first, out, r = self.convert(user, x, rank)
            more, end, _ = self.chain(out, r, join)
            branches.append(([first, *more] if first is not None else more, end))
        if sorted(end for _, end in branches) != sorted(join.input):
            raise ImportRefused(f"{_where(join)} does not add the two branches that fork at "
                                f"{x!r}")
        # the identity, else the shorter branch (torchvision's downsample) is the shortcut
        short, body = sorted(branches, key=lambda b: len(b[0]))
        if not body[0]:
            raise ImportRefused(f"{_where(join)} adds a tensor to itself; a residual block "
                                f"needs at least one layer in its body")
        block: dict[str, Any] = {"type": "residual", "layers": body[0]}
        if short[0]:
            block["shortcut"] = short[0]
        return block, join.output[0], rank

    def meeting(self, users: list[Any]) -> Any:
        """The first node (in topological order) both branches reach."""
        reach = [self.reachable(u) for u in users]
        common = reach[0] & reach[1]
        if not common:
            raise ImportRefused(f"the branches from {_where(users[0])} and {_where(users[1])} "
                                f"never meet; model.layers is one chain with residual blocks")
        return self.nodes[min(common)]

    def reachable(self, start: Any) -> set[int]:
        seen: set[int] = set()
        todo = [start]
        while todo:
            node = todo.pop()
            if self.index[id(node)] in seen:
                continue
            seen.add(self.index[id(node)])
            for out in node.output:
                todo.extend(self.users.get(out, []))
        return seen

    def convert(self, node: Any, x: str, rank: str) -> tuple[dict[str, Any] | None, str, str]:
        """One node as a layer (None: no layer), the tensor it gives and that tensor's rank."""
        convert = _CONVERTERS.get(node.op_type)
        if convert is None:
            raise _refuse(node)
        dynamic = {i for i in node.input if i and i not in self.consts}
        if len(dynamic) > 1:
            raise ImportRefused(f"{_where(node)} takes {len(dynamic)} computed inputs where "
                                f"model.layers has one (only an Add joins branches)")
        if node.input[0] != x and node.op_type != "Add":
            raise ImportRefused(f"{_where(node)} takes the computed tensor as input "
                                f"{list(node.input).index(x)}; a layer takes it first")
        if rank != SPATIAL and node.op_type in ("Conv", "MaxPool", "AveragePool",
                                                "GlobalAveragePool", "ReduceMean"):
            raise ImportRefused(f"{_where(node)} needs feature maps (N, C, H, W), but it comes "
                                f"after global pooling or flattening, which model.layers makes "
                                f"(C,): classify with Flatten and Gemm instead")
        return convert(self, node, x, rank)

    def input_shape(self) -> tuple[int, int, int] | None:
        dims = _dims(self.input_info)
        if dims is None or len(dims) != 4 or any(d is None for d in dims[1:]):
            return None
        return (int(dims[1]), int(dims[2]), int(dims[3]))  # type: ignore[arg-type]

    def num_classes(self) -> int | None:
        dims = _dims(self.output_info)
        return dims[-1] if dims and len(dims) == 2 else None


def _dims(info: Any) -> list[int | None] | None:
    t = info.type.tensor_type
    if not t.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]


def _constant(node: Any) -> Any:
    """A Constant node's value as a TensorProto."""
    from onnx import helper, numpy_helper

    a = _attrs(node)
    if "value" in a:
        return a["value"]
    for key, dtype in (("value_float", np.float32), ("value_floats", np.float32),
                       ("value_int", np.int64), ("value_ints", np.int64)):
        if key in a:
            return numpy_helper.from_array(np.asarray(a[key], dtype), node.output[0])
    raise ImportRefused(f"{_where(node)} holds a {', '.join(a) or 'missing'} value; "
                        f"{helper.printable_node(node)}")


def _refuse(node: Any) -> ImportRefused:
    return ImportRefused(f"unsupported operator {node.op_type} (node "
                         f"{node.name or node.output[0]!r}): model.layers is made of "
                         f"{', '.join(SUPPORTED[:-2])}")


def _square(node: Any, key: str, values: list[int], what: str) -> int:
    if len(set(values)) != 1:
        raise ImportRefused(f"{_where(node)}: {key} {values} differ; model.layers' {what} is "
                            f"the same in height and width")
    return int(values[0])


def _window(node: Any, kernel: list[int]) -> tuple[int, int, int]:
    """A square kernel, one stride, one padding on every side, no dilation: or refused."""
    a = _attrs(node)
    if a.get("auto_pad", b"NOTSET") not in (b"NOTSET", b"VALID", "NOTSET", "VALID"):
        raise ImportRefused(f"{_where(node)}: auto_pad {a['auto_pad']!r} is not supported; "
                            f"give explicit pads")
    if any(d != 1 for d in a.get("dilations", [1])):
        raise ImportRefused(f"{_where(node)}: dilations {a['dilations']} are not supported")
    if a.get("ceil_mode", 0):
        raise ImportRefused(f"{_where(node)}: ceil_mode=1 is not supported (model.layers' "
                            f"pools round down)")
    k = _square(node, "kernel_shape", list(a.get("kernel_shape", kernel)), "kernel")
    s = _square(node, "strides", list(a.get("strides", [1, 1])), "stride")
    p = _square(node, "pads", list(a.get("pads", [0, 0, 0, 0])), "padding")
    return k, s, p


# -- one converter per operator ----------------------------------------------------------------

Result = tuple[dict[str, Any] | None, str, str]


def _conv(g: _Graph, node: Any, x: str, rank: str) -> Result:
    w = g.const(node, 1, "weight")
    cout, cin_per_group, kh, kw = (int(d) for d in w.dims)
    k, s, p = _window(node, [kh, kw])
    group = int(_attrs(node).get("group", 1))
    bias = len(node.input) > 2 and bool(node.input[2])
    name = g.layer_name(node, node.input[1])
    if group == 1:
        layer = {"type": "conv2d", "out_channels": cout, "kernel": k, "stride": s,
                 "padding": p, "bias": bias, "name": name}
    elif group == cout and cin_per_group == 1:
        if bias:
            raise ImportRefused(f"{_where(node)}: a depthwise convolution with a bias; "
                                f"model.layers' depthwise_conv2d has none (a batch norm folded "
                                f"into it? export with do_constant_folding=False)")
        layer = {"type": "depthwise_conv2d", "kernel": k, "stride": s, "padding": p,
                 "name": name}
    else:
        raise ImportRefused(f"{_where(node)}: a grouped convolution (group={group}); "
                            f"model.layers has plain (1) and depthwise ones")
    g.keep(name, "weight", node, 1)
    if bias:
        g.keep(name, "bias", node, 2)
    return layer, node.output[0], SPATIAL


def _dense_weight(g: _Graph, node: Any, transpose: bool) -> str:
    """The layer's name, its weight kept as the engine's (units, features)."""
    name = g.layer_name(node, node.input[1])
    g.keep(name, "weight", node, 1, (lambda w: w.T) if transpose else np.asarray)
    return name


def _gemm(g: _Graph, node: Any, x: str, rank: str) -> Result:
    a = _attrs(node)
    if a.get("transA", 0) or a.get("alpha", 1.0) != 1.0 or a.get("beta", 1.0) != 1.0:
        raise ImportRefused(f"{_where(node)}: transA, alpha or beta other than 0, 1, 1")
    w = g.const(node, 1, "weight")
    trans_b = bool(a.get("transB", 0))
    units = int(w.dims[0] if trans_b else w.dims[1])
    name = _dense_weight(g, node, transpose=not trans_b)
    if len(node.input) > 2 and node.input[2]:
        g.keep(name, "bias", node, 2, lambda b: np.broadcast_to(b, (units,)).ravel())
    elif g.weights:
        g.arrays[f"{name}.bias"] = np.zeros(units, np.float32)  # a dense layer has one
    return {"type": "dense", "units": units, "name": name}, node.output[0], FLAT


def _matmul(g: _Graph, node: Any, x: str, rank: str) -> Result:
    w = g.const(node, 1, "weight")
    if len(w.dims) != 2:
        raise ImportRefused(f"{_where(node)}: a weight of {len(w.dims)} dimensions; a dense "
                            f"layer's is (features, units)")
    units = int(w.dims[1])
    name = _dense_weight(g, node, transpose=True)
    out = node.output[0]
    users = g.next_users(out)
    bias_add = users[0] if len(users) == 1 and users[0].op_type == "Add" else None
    if bias_add is not None:  # x @ W + b: the Add is the dense layer's bias
        other = [i for i in bias_add.input if i != out]
        if len(other) == 1 and other[0] in g.consts:
            g.keep(name, "bias", bias_add, list(bias_add.input).index(other[0]),
                   lambda b: np.broadcast_to(b, (units,)).ravel())
            return {"type": "dense", "units": units, "name": name}, bias_add.output[0], FLAT
    if g.weights:
        g.arrays[f"{name}.bias"] = np.zeros(units, np.float32)
    return {"type": "dense", "units": units, "name": name}, out, FLAT


def _batchnorm(g: _Graph, node: Any, x: str, rank: str) -> Result:
    name = g.layer_name(node, node.input[1])
    for i, key in enumerate(("weight", "bias", "running_mean", "running_var"), start=1):
        g.const(node, i, key)
        g.keep(name, key, node, i)
    return {"type": "batchnorm", "name": name}, node.output[0], rank


def _clip(g: _Graph, node: Any, x: str, rank: str) -> Result:
    a = _attrs(node)
    low, high = g.optional(node, 1), g.optional(node, 2)
    lo = float(low) if low is not None else a.get("min", -math.inf)
    hi = float(high) if high is not None else a.get("max", math.inf)
    if lo == 0.0 and hi == 6.0:
        return {"type": "relu6"}, node.output[0], rank
    if lo == 0.0 and hi == math.inf:
        return {"type": "relu"}, node.output[0], rank
    raise ImportRefused(f"{_where(node)} clips to [{lo}, {hi}]; model.layers clips to [0, 6] "
                        f"(relu6) or [0, inf) (relu)")


def _pool(g: _Graph, node: Any, x: str, rank: str) -> Result:
    k, s, p = _window(node, [])
    kind = "maxpool" if node.op_type == "MaxPool" else "avgpool"
    if kind == "avgpool" and p and not _attrs(node).get("count_include_pad", 0):
        raise ImportRefused(f"{_where(node)}: padding left out of the average "
                            f"(count_include_pad=0); model.layers' avgpool counts it as zeros")
    if len([o for o in node.output if o]) > 1:
        raise ImportRefused(f"{_where(node)}: its indices output is not supported")
    return {"type": kind, "kernel": k, "stride": s, "padding": p}, node.output[0], SPATIAL


def _reduce_mean(g: _Graph, node: Any, x: str, rank: str) -> Result:
    a = _attrs(node)
    given = g.optional(node, 1)
    axes = sorted(int(v) % 4 for v in (given if given is not None else a.get("axes", [])))
    if axes != [2, 3]:
        raise ImportRefused(f"{_where(node)} averages over axes {axes}; only the mean over "
                            f"height and width (2, 3) is a layer (global_avgpool)")
    return {"type": "global_avgpool"}, node.output[0], POOLED if a.get("keepdims", 1) else FLAT


def _flatten(g: _Graph, node: Any, x: str, rank: str) -> Result:
    if node.op_type == "Reshape":
        shape = g.value(node, 1, "shape")
        if shape.ndim != 1 or len(shape) != 2:
            raise ImportRefused(f"{_where(node)} reshapes to {shape.tolist()}; only a flatten "
                                f"to (N, features) is a layer")
    elif _attrs(node).get("axis", 1) != 1:
        raise ImportRefused(f"{_where(node)}: axis {_attrs(node)['axis']}; a flatten keeps "
                            f"the batch axis (axis=1)")
    layer = {"type": "flatten"} if rank == SPATIAL else None  # global pooling gave (C,)
    return layer, node.output[0], FLAT


def _dropout(g: _Graph, node: Any, x: str, rank: str) -> Result:
    ratio = g.optional(node, 1)
    rate = float(ratio) if ratio is not None else float(_attrs(node).get("ratio", 0.5))
    return {"type": "dropout", "rate": rate}, node.output[0], rank


def _relu(g: _Graph, node: Any, x: str, rank: str) -> Result:
    return {"type": "relu"}, node.output[0], rank


def _global_pool(g: _Graph, node: Any, x: str, rank: str) -> Result:
    return {"type": "global_avgpool"}, node.output[0], POOLED


def _identity(g: _Graph, node: Any, x: str, rank: str) -> Result:
    return None, node.output[0], rank


def _add(g: _Graph, node: Any, x: str, rank: str) -> Result:
    raise ImportRefused(f"{_where(node)} adds a constant; model.layers adds one only as a "
                        f"dense layer's bias (right after a MatMul)")


_CONVERTERS: dict[str, Callable[[_Graph, Any, str, str], Result]] = {
    "Conv": _conv, "Gemm": _gemm, "MatMul": _matmul, "Relu": _relu, "Clip": _clip,
    "BatchNormalization": _batchnorm, "MaxPool": _pool, "AveragePool": _pool,
    "GlobalAveragePool": _global_pool, "ReduceMean": _reduce_mean, "Flatten": _flatten,
    "Reshape": _flatten, "Dropout": _dropout, "Identity": _identity, "Add": _add,
}
