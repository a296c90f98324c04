"""A job's trained arrays, rebuilt into its model and written as ONNX, safetensors or torch.

The checkpoint's arrays already carry the names a torch user expects (torchvision's for the
built-ins, the layer names for the rest: engine.checkpoint). What a strict `load_state_dict`
also wants and the engine does not keep is each batch norm's `num_batches_tracked`: it is
written as the checkpoint's step (one running-statistics update per step).
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.runner import JobModel, job_model
from phalanx.modelio import need

FORMATS = ("onnx", "safetensors", "torch")
SUFFIXES = {"onnx": ".onnx", "safetensors": ".safetensors", "torch": ".pt"}
BN_COUNTER = "num_batches_tracked"


@dataclass(frozen=True)
class DatasetFacts:
    """What the model is built for: the dataset's size, input shape (C, H, W) and classes."""

    n_train: int
    input_shape: tuple[int, int, int]
    num_classes: int


@dataclass(frozen=True)
class Trained:
    """A job's model and its trained parameters and buffers, by name (float32)."""

    job: JobModel
    params: dict[str, np.ndarray]
    buffers: dict[str, np.ndarray]
    step: int
    metadata: dict[str, str] = field(default_factory=dict)


def load_trained(spec: dict[str, Any], facts: DatasetFacts,
                 arrays: Mapping[str, np.ndarray]) -> Trained:
    """The spec's model with the checkpoint's `arrays` (an .npz's, by name); ValueError when
    the spec does not build or an array is missing or misshapen."""
    job = job_model(spec, facts.n_train, facts.input_shape, facts.num_classes)
    model = job.model
    params = {name: _array(arrays, name, s.shape) for name, s in model.layout.items()}
    buffers = {name: _array(arrays, name, s.shape) for name, s in model.buffer_layout.items()}
    step = int(np.asarray(arrays["step"])) if "step" in arrays else 0
    meta = {"arch": job.spec.arch, "dataset": job.spec.dataset, "step": str(step),
            "input_shape": "x".join(str(d) for d in facts.input_shape),
            "num_classes": str(facts.num_classes)}
    return Trained(job, params, buffers, step, meta)


def _array(arrays: Mapping[str, np.ndarray], name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name not in arrays:
        raise ValueError(f"the checkpoint has no array {name!r}: is it this job's?")
    value = np.asarray(arrays[name])
    if value.shape != shape:
        raise ValueError(f"the checkpoint's {name!r} has shape {value.shape}; the model's is "
                         f"{shape}")
    return value.astype(np.float32, copy=False)


def state_dict(trained: Trained) -> dict[str, np.ndarray]:
    """Parameters and buffers in module order, as torch's `state_dict()` lists them: each batch
    norm's weight, bias, running_mean, running_var, num_batches_tracked (int64 scalar)."""
    out: dict[str, np.ndarray] = {}
    for name, value in trained.params.items():
        out[name] = value
        prefix = name.removesuffix(".bias")
        if name.endswith(".bias") and f"{prefix}.running_mean" in trained.buffers:
            for buf in ("running_mean", "running_var"):
                out[f"{prefix}.{buf}"] = trained.buffers[f"{prefix}.{buf}"]
            out[f"{prefix}.{BN_COUNTER}"] = np.array(trained.step, np.int64)
    return out


def safetensors_bytes(trained: Trained) -> bytes:
    st = need("safetensors.numpy")
    tensors = {k: np.ascontiguousarray(v) for k, v in state_dict(trained).items()}
    return bytes(st.save(tensors, metadata=trained.metadata))


def torch_bytes(trained: Trained) -> bytes:
    """`torch.save` of a plain dict of tensors: `torch.load(f, weights_only=True)` reads it."""
    torch = need("torch")
    tensors = {k: torch.from_numpy(np.array(v)) for k, v in state_dict(trained).items()}
    buf = io.BytesIO()
    torch.save(tensors, buf)
    return buf.getvalue()


def export_bytes(trained: Trained, fmt: str) -> bytes:
    """The trained model in `fmt` (one of FORMATS)."""
    if fmt == "onnx":
        from phalanx.modelio.onnx_export import onnx_model

        return bytes(onnx_model(trained).SerializeToString())
    if fmt == "safetensors":
        return safetensors_bytes(trained)
    if fmt == "torch":
        return torch_bytes(trained)
    raise ValueError(f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")
