"""A job's model rebuilt from its spec, with a checkpoint's arrays by name: what every export
format writes (phalanx.modelio.export, phalanx.modelio.onnx_export)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from engine.runner import JobModel, job_model


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
