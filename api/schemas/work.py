"""Step-protocol responses (docs/contracts.md, "Step protocol")."""

from __future__ import annotations

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


class DivergedOut(BaseModel):
    failed: bool = Field(description="true: this report failed the job; false: it had already "
                         "moved on (another report, or it finished)")
