"""A trained model's forward graph as ONNX, in inference mode (batch norm with its running
statistics, dropout gone): what ONNX Runtime (Mobile) runs in an app.

The graph is written from the model's layer graph (engine.models.graph: the built-ins are
layer graphs too), one ONNX node or two per layer, so every model Phalanx trains exports. The
layers are walked with the engine's naming rule (docs/models.md: a layer's `name`, else its
place: `layers.3`, `layers.3.body.0`), which keys each parameter; initializers keep those
names (`layer1.0.conv1.weight`). Input `input` is float32 (N, C, H, W), samples as the
dataset's rule gives them (engine.stored.normalize); output `logits` is (N, classes).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.models import graph
from engine.norm import EPS
from phalanx.modelio import need
from phalanx.modelio.trained import Trained

OPSET = 17  # ONNX Runtime 1.14+ (Mobile included) runs it
IR_VERSION = 8  # opset 17's; a newer IR would shut out older runtimes for nothing
INPUT, OUTPUT = "input", "logits"
# docs/models.md's defaults; pool stride 0 means the kernel, conv padding None means kernel // 2
_DEFAULTS: dict[str, dict[str, Any]] = {
    "conv2d": {"kernel": 3, "stride": 1, "padding": None, "bias": True},
    "depthwise_conv2d": {"kernel": 3, "stride": 1, "padding": None},
    "maxpool": {"kernel": 2, "stride": 0, "padding": 0},
    "avgpool": {"kernel": 2, "stride": 0, "padding": 0},
}


class _Writer:
    """Nodes and initializers collected while the layer graph is walked."""

    def __init__(self, trained: Trained) -> None:
        self.onnx = need("onnx")
        self.arrays = {**trained.params, **trained.buffers}
        self.nodes: list[Any] = []
        self.inits: list[Any] = []
        self.relu6_bounds: tuple[str, str] | None = None
        self.used = {INPUT, OUTPUT, "relu6.min", "relu6.max", *self.arrays}

    def node(self, op: str, inputs: list[str], name: str, **attrs: Any) -> str:
        """One node named after its layer; its output tensor too, made unique (a user's layer
        may be called `input` or `conv1.weight`)."""
        out, n = name, 1
        while out in self.used:
            out, n = f"{name}#{n}", n + 1
        self.used.add(out)
        self.nodes.append(self.onnx.helper.make_node(op, inputs, [out], name=out, **attrs))
        return out

    def init(self, name: str) -> str:
        from onnx import numpy_helper

        self.inits.append(numpy_helper.from_array(np.ascontiguousarray(self.arrays[name]), name))
        return name

    def sequence(self, layers: list[dict[str, Any]], x: str, prefix: str) -> str:
        for i, spec in enumerate(layers):
            x = self.layer(spec, x, spec.get("name") or f"{prefix}{i}")
        return x

    def layer(self, spec: dict[str, Any], x: str, name: str) -> str:
        kind = spec["type"]
        o = {**_DEFAULTS.get(kind, {}), **spec}
        if kind in ("conv2d", "depthwise_conv2d"):
            return self.conv(kind, o, x, name)
        if kind == "dense":
            return self.node("Gemm", [x, self.init(f"{name}.weight"), self.init(f"{name}.bias")],
                             name, transB=1)
        if kind == "batchnorm":
            ins = [self.init(f"{name}.{p}") for p in ("weight", "bias", "running_mean",
                                                      "running_var")]
            return self.node("BatchNormalization", [x, *ins], name, epsilon=EPS)
        if kind in ("maxpool", "avgpool"):
            k, p = o["kernel"], o["padding"]
            extra = {"count_include_pad": 1} if kind == "avgpool" else {}  # as the engine counts
            return self.node("MaxPool" if kind == "maxpool" else "AveragePool", [x], name,
                             kernel_shape=[k, k], strides=[o["stride"] or k] * 2,
                             pads=[p] * 4, **extra)
        if kind == "residual":
            body = self.sequence(spec["layers"], x, f"{name}.body.")
            short = self.sequence(spec.get("shortcut") or [], x, f"{name}.shortcut.")
            return self.node("Add", [body, short], name)
        return self.simple(kind, x, name)

    def conv(self, kind: str, o: dict[str, Any], x: str, name: str) -> str:
        k = o["kernel"]
        p = k // 2 if o["padding"] is None else o["padding"]
        ins = [x, self.init(f"{name}.weight")]
        if kind == "conv2d" and o["bias"]:
            ins.append(self.init(f"{name}.bias"))
        groups = self.arrays[f"{name}.weight"].shape[0] if kind == "depthwise_conv2d" else 1
        return self.node("Conv", ins, name, kernel_shape=[k, k], strides=[o["stride"]] * 2,
                         pads=[p] * 4, group=groups)

    def simple(self, kind: str, x: str, name: str) -> str:
        if kind == "relu":
            return self.node("Relu", [x], name)
        if kind == "relu6":
            return self.node("Clip", [x, *self.bounds()], name)
        if kind == "global_avgpool":  # (N, C, 1, 1) flattened to the engine's (N, C)
            pooled = self.node("GlobalAveragePool", [x], f"{name}.pool")
            return self.node("Flatten", [pooled], name, axis=1)
        if kind == "flatten":  # NCHW order, as the engine flattens
            return self.node("Flatten", [x], name, axis=1)
        if kind == "dropout":  # inference: the identity
            return x
        raise ValueError(f"layer type {kind!r} has no ONNX form here")

    def bounds(self) -> tuple[str, str]:
        if self.relu6_bounds is None:
            from onnx import numpy_helper

            for name, value in (("relu6.min", 0.0), ("relu6.max", 6.0)):
                self.inits.append(numpy_helper.from_array(np.array(value, np.float32), name))
            self.relu6_bounds = ("relu6.min", "relu6.max")
        return self.relu6_bounds


def onnx_model(trained: Trained, check: bool = True) -> Any:
    """The ONNX ModelProto of `trained`'s forward graph, checked by onnx.checker."""
    onnx = need("onnx")
    job = trained.job
    layers = graph(job.spec.arch, job.model.input_shape, job.model.num_classes,
                   job.spec.model_options)
    w = _Writer(trained)
    out = w.sequence(layers, INPUT, "layers.")
    w.nodes.append(onnx.helper.make_node("Identity", [out], [OUTPUT], name=OUTPUT))
    h = onnx.helper
    f32 = onnx.TensorProto.FLOAT
    graph_proto = h.make_graph(
        w.nodes, f"phalanx-{job.spec.arch}",
        [h.make_tensor_value_info(INPUT, f32, ["N", *job.model.input_shape])],
        [h.make_tensor_value_info(OUTPUT, f32, ["N", job.model.num_classes])], w.inits)
    model = h.make_model(graph_proto, producer_name="phalanx", ir_version=IR_VERSION,
                         opset_imports=[h.make_opsetid("", OPSET)],
                         doc_string="logits of a Phalanx-trained model; softmax gives "
                                    "class probabilities")
    h.set_model_props(model, trained.metadata)
    if check:
        onnx.checker.check_model(model, full_check=True)
    return model
