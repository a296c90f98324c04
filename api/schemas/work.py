"""Step-protocol responses (docs/contracts.md, "Step protocol")."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict


class Assignment(BaseModel):
    model_config = ConfigDict(extra="forbid")

    job_id: str
    step: int
    shards: list[int]
    spec: dict[str, Any]
    n_params: int
    n_buffers: int
    n_stats: int
    total_steps: int
    n_train: int
    input_shape: list[int]
    num_classes: int
    bulk_url: str | None = None  # where to POST gradients (api.steps.bulk_listener); else the API


class WorkOut(BaseModel):
    assignment: Assignment | None = None


class UploadOut(BaseModel):
    accepted: list[int]
    duplicates: list[int]
