"""A step request as the agent's runtime hands it to its compute worker (weights and shard data
on disk), built for step 0 of a job spec with the real engine. Not a control plane: the agent's
runtime is tested against the real one (tests/agent/test_runtime.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from engine.data import dataset_info, load_dataset
from engine.graph import Model
from engine.models import build_model
from engine.sampler import shard_indices
from engine.spec import TrainSpec
from engine.step import TrainState, initial_state
from tests.support.arrays import npz_bytes
from wire.messages import encode_weights

JOB_ID = "job-test"


@dataclass
class StepZero:
    spec_json: dict[str, Any]
    spec: TrainSpec
    model: Model
    state: TrainState
    shard_blobs: dict[int, bytes]
    n_train: int
    input_shape: tuple[int, ...]
    num_classes: int


def step_zero(spec_json: dict[str, Any]) -> StepZero:
    info = dataset_info(spec_json["dataset"])
    spec = TrainSpec.from_job_spec(spec_json, n_train=info.n_train)
    options = {k: v for k, v in spec_json["model"].items() if k != "arch"}
    model = build_model(spec.arch, info.input_shape, info.num_classes, options)
    data = load_dataset(spec_json["dataset"])
    blobs = {}
    for k, idx in enumerate(shard_indices(info.n_train, spec.shards, spec.seed)):
        blobs[k] = npz_bytes(x=data.x_train[idx].astype(np.float32),
                             y=data.y_train[idx].astype(np.int64))
    return StepZero(spec_json, spec, model, initial_state(model, spec), blobs, info.n_train,
                    tuple(info.input_shape), info.num_classes)


def make_request(s: StepZero, tmp_path: Path, shard: int) -> dict[str, Any]:
    """The worker's request for `shard` at step 0, with the weights and the shard on disk."""
    weights = tmp_path / "weights.bin"
    weights.write_bytes(encode_weights(JOB_ID, 0, s.state.params, s.state.buffers))
    path = tmp_path / f"shard-{shard}.npz"
    path.write_bytes(s.shard_blobs[shard])
    return {"job_id": JOB_ID, "step": 0, "spec": s.spec_json, "n_train": s.n_train,
            "input_shape": list(s.input_shape), "num_classes": s.num_classes,
            "weights_path": str(weights), "shards": {str(shard): str(path)},
            "out_path": str(tmp_path / "result.bin"), "_n_params": s.model.n_params}
