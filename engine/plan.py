"""What a job will cost before it runs: parameters, FLOPs, a phone's memory, bytes per step.

Estimates, computed from the layer graph without allocating the model (docs/models.md):

* FLOPs per sample, forward + backward: 3 x the forward's (the backward computes the input's
  and the weights' gradients, about two forwards), the forward being 2 x multiply-adds of
  convolutions, dense layers and pooling windows plus one operation per element elsewhere.
* A phone's memory for one micro-batch, i.e. per shard it computes at a time (a phone computing
  N shards side by side on N cores needs up to N times the activations): the received
  weights, their float32 copy for compute, the gradient and its upload (4 x 4 bytes per
  parameter), every layer's output kept for the backward and its gradient (2 x 4 bytes per
  activation per sample), and the agent's own runtime (numpy, buffers).
* Bytes per step: every device downloads the weights once and uploads one gradient (with its
  batch statistics) per tree node its shards fill (engine.tree), or per shard where the job's
  upload precision allows no partials.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from engine.layerspec import LayerInfo
from engine.models import layer_infos, parameter_slots
from engine.precision import can_pre_add
from engine.slices import Bounds, slice_bounds
from engine.spec import TrainSpec
from engine.tree import cover

RUNTIME_BYTES = 64 << 20  # the agent's Python, numpy and buffers, measured on a phone: ~60 MiB
_COUNTED_MACS = ("conv2d", "depthwise_conv2d", "dense", "maxpool", "avgpool")


@dataclass(frozen=True)
class ModelPlan:
    parameters: int
    flops_per_sample: int  # forward + backward
    micro_batch: int  # samples each shard computes per step
    memory_bytes: int  # a phone's peak for one micro-batch
    total_steps: int
    weights_bytes: int  # downloaded by every device, every step
    gradient_bytes: int  # one upload: a shard's result, or a partial of several (engine.tree)
    pre_adds: bool  # phones upload partials (engine.precision.can_pre_add)
    layers: tuple[LayerInfo, ...]
    slices: tuple[Bounds, ...] = ((0, 0),)  # the vector's parts applied apart (engine.slices)

    def bytes_per_step(self, devices: int, shards: int) -> int:
        """Weights down to every device, and up one result per tree node each device's shards
        fill (pre-added on the phone), the shards split evenly in contiguous runs as placement
        first splits them: at best, since a phone running late uploads what it holds before
        its nodes are filled (agent.runtime.work)."""
        devices = max(1, min(devices, shards))
        if not self.pre_adds:
            return devices * self.weights_bytes + shards * self.gradient_bytes
        uploads = sum(len(cover(range(i * shards // devices, (i + 1) * shards // devices), shards))
                      for i in range(devices))
        return devices * self.weights_bytes + uploads * self.gradient_bytes

    def as_dict(self, devices: int, shards: int) -> dict[str, Any]:
        return {
            "parameters": self.parameters,
            "flops_per_sample": self.flops_per_sample,
            "flops_per_step": self.flops_per_sample * self.micro_batch * shards,
            "micro_batch": self.micro_batch,
            "memory_per_device_bytes": self.memory_bytes,
            "total_steps": self.total_steps,
            "weights_bytes": self.weights_bytes,
            "gradient_bytes": self.gradient_bytes,
            "bytes_per_step": self.bytes_per_step(devices, shards),
            # each slice's step is applied by its own task: the largest bounds one task's bytes
            "slices": len(self.slices),
            "largest_slice_parameters": max(hi - lo for lo, hi in self.slices),
            "devices_counted": devices,
            "layers": [{"path": i.path, "type": i.type, "out_shape": list(i.out_shape),
                        "parameters": i.params, "flops_per_sample": 3 * _forward_flops(i)}
                       for i in self.layers],
        }


def _forward_flops(info: LayerInfo) -> int:
    return 2 * info.macs if info.type in _COUNTED_MACS else info.macs


def model_plan(train: TrainSpec, input_shape: tuple[int, ...], num_classes: int) -> ModelPlan:
    """The plan of `train` on a dataset of `input_shape` samples and `num_classes` classes
    (train.n_train set); ValueError when the model cannot be built."""
    options = train.model_options
    slots = parameter_slots(train.arch, input_shape, num_classes, options)
    n_params = sum(s.size for s in slots)
    infos = layer_infos(train.arch, input_shape, num_classes, options)
    # batch-norm buffers travel with the weights, their statistics with each gradient
    n_bn = 2 * sum(i.out_shape[0] for i in infos if i.type == "batchnorm")
    m = train.per_shard_batch
    activations = sum(i.activations for i in infos) + _elements(input_shape)
    memory = 16 * n_params + 8 * activations * m + RUNTIME_BYTES
    return ModelPlan(
        parameters=n_params,
        flops_per_sample=3 * sum(_forward_flops(i) for i in infos),
        micro_batch=m,
        memory_bytes=memory,
        total_steps=train.total_steps,
        weights_bytes=4 * (n_params + n_bn),
        # the gradient in the job's upload precision, the batch statistics in float32
        gradient_bytes=(2 if train.upload_precision != "float32" else 4) * n_params + 4 * n_bn,
        pre_adds=can_pre_add(train.upload_precision),
        layers=tuple(infos),
        slices=tuple(slice_bounds(slots, n_params, train.slices)),
    )


def _elements(shape: tuple[int, ...]) -> int:
    out = 1
    for d in shape:
        out *= int(d)
    return out
