"""A job's engine objects (spec, model, sizes), built once per process per job spec."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engine.data import DatasetError, dataset_info
from engine.runner import JobModel, job_model
from engine.slices import Bounds, slice_bounds


@dataclass(frozen=True)
class JobInfo(JobModel):
    """A job's engine objects (engine.runner.JobModel) and what an assignment tells a phone."""

    @property
    def total_steps(self) -> int:
        return self.spec.total_steps

    @functools.cached_property
    def slices(self) -> list[Bounds]:
        """The vector's parts applied apart (engine.slices): [(0, n_params)] unless sliced."""
        return slice_bounds(list(self.model.layout.values()), self.model.n_params,
                            self.spec.slices)

    def assignment_facts(self) -> dict[str, Any]:
        return {
            "n_params": self.model.n_params,
            "n_buffers": self.model.n_buffers,
            "n_stats": self.model.n_stats,
            "total_steps": self.total_steps,
            "n_train": self.n_train,
            "input_shape": list(self.input_shape),
            "num_classes": self.num_classes,
        }


def job_info(job_id: str, spec: dict[str, Any], data_dir: Path | str | None) -> JobInfo:
    return _job_info(job_id, json.dumps(spec, sort_keys=True), str(data_dir) if data_dir else None)


def job_info_or_reason(job_id: str, spec: dict[str, Any], data_dir: Path | str | None
                       ) -> tuple[JobInfo | None, str | None]:
    """The job's engine objects, or why the engine cannot run it (e.g. its upload was deleted)."""
    try:
        return job_info(job_id, spec, data_dir), None
    except (DatasetError, ValueError, MemoryError) as exc:  # SpecError, ModelTooLarge: ValueError
        return None, f"cannot run this spec: {exc}"


@functools.lru_cache(maxsize=64)
def _job_info(job_id: str, spec_json: str, data_dir: str | None) -> JobInfo:
    raw = json.loads(spec_json)
    info = dataset_info(str(raw.get("dataset", "")), data_dir)
    built = job_model(raw, info.n_train, info.input_shape, info.num_classes)
    return JobInfo(built.spec, built.model, built.n_train, built.input_shape, built.num_classes)
