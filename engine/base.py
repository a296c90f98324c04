"""What every layer shares: the flat-vector layout builder and the per-call context.

A layer declares its parameters, buffers and batch statistics once (`build`), gets named views
into the flat vectors at run time, and keeps its numpy forward, numpy backward and torch forward
side by side. numpy activations are NHWC inside the engine (channels last makes 1x1 convs plain
GEMMs and im2col one contiguous copy); shapes in the layout and on the wire are canonical
PyTorch order (OIHW weights, NCHW data), so the torch backend reads the same vector.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.kernels import CLASS, Kernels

DROPOUT_TAG = 0xD809  # keeps dropout streams apart from init and sampler streams


@dataclass(frozen=True)
class Slot:
    """One named array inside a flat vector."""

    name: str
    offset: int
    shape: tuple[int, ...]
    init: str = "zeros"  # he | glorot | zeros | ones
    fan_in: int = 1
    fan_out: int = 1
    decay: bool = False  # weight decay applies (kernels, not biases or BN)

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    def view(self, flat: Any) -> Any:
        """A shaped view of this slot in `flat` (numpy or torch)."""
        return flat[self.offset : self.offset + self.size].reshape(self.shape)


class Builder:
    """Collects slots while a network is built; offsets follow declaration order."""

    def __init__(self) -> None:
        self.params: list[Slot] = []
        self.buffers: list[Slot] = []
        self.stats: list[Slot] = []
        self.n_layers = 0
        self.largest_activation = 0  # elements of the biggest layer output, per sample

    def param(self, name: str, shape: tuple[int, ...], init: str, fan_in: int = 1,
              fan_out: int = 1, decay: bool = False) -> str:
        self.params.append(Slot(name, _end(self.params), shape, init, fan_in, fan_out, decay))
        return name

    def buffer(self, name: str, shape: tuple[int, ...], init: str) -> str:
        self.buffers.append(Slot(name, _end(self.buffers), shape, init))
        return name

    def stat(self, name: str, shape: tuple[int, ...]) -> str:
        self.stats.append(Slot(name, _end(self.stats), shape))
        return name

    def next_index(self) -> int:
        self.n_layers += 1
        return self.n_layers - 1


def _end(slots: list[Slot]) -> int:
    return slots[-1].offset + slots[-1].size if slots else 0


@dataclass
class Ctx:
    """Per-call context: mode, the seeds of dropout masks, buffers in, batch statistics out,
    and the kernels that multiply and sum (engine.kernels: the job's exactness)."""

    training: bool
    seed: int = 0
    step: int = 0
    shard: int = 0
    buffers: dict[str, Any] = field(default_factory=dict)
    stats: dict[str, Any] = field(default_factory=dict)
    kernels: Kernels = CLASS

    def rng(self, layer_index: int) -> np.random.Generator:
        words = [self.seed, self.step, self.shard, layer_index, DROPOUT_TAG]
        return np.random.default_rng(np.random.SeedSequence(words))


class Layer:
    """Base: a layer without parameters whose output shape equals its input shape."""

    name: str = ""

    def build(self, in_shape: tuple[int, ...], b: Builder) -> tuple[int, ...]:
        return in_shape

    def forward(self, x: np.ndarray, P: dict[str, np.ndarray], ctx: Ctx) -> tuple[np.ndarray, Any]:
        raise NotImplementedError

    def backward(self, dy: np.ndarray, cache: Any, P: dict[str, np.ndarray],
                 G: dict[str, np.ndarray], need_dx: bool = True) -> np.ndarray | None:
        raise NotImplementedError

    def torch_forward(self, x: Any, P: dict[str, Any], ctx: Ctx) -> Any:
        raise NotImplementedError


def to_nhwc(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.transpose(0, 2, 3, 1)) if x.ndim == 4 else x


def to_nchw(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.transpose(0, 3, 1, 2)) if x.ndim == 4 else x
