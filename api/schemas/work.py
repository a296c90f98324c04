"""Step-protocol responses (docs/contracts.md, "Step protocol")."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from wire.assignment import Assignment


class WorkOut(BaseModel):
    assignment: Assignment | None = None


class UploadOut(BaseModel):
    accepted: list[int]
    duplicates: list[int]


class DivergedIn(BaseModel):
    """A device's word that its shard's result at this step is not finite (docs/contracts.md)."""

    shard: int = Field(ge=0, description="the shard whose loss or gradient is not finite")
    reason: str = Field(min_length=1, max_length=500,
                        description="what the device saw, e.g. \"shard 3: gradient is not finite\"")
    kind: Literal["diverged", "compute_error"] = Field(
        "diverged", description="diverged: the result is not finite; compute_error: the engine "
        "raised the same error on every try (e.g. the model does not fit the phone's memory)")


class DivergedOut(BaseModel):
    failed: bool = Field(description="true: this report failed the job; false: it had already "
                         "moved on (another report, or it finished)")
