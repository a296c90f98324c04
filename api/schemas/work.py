"""Step-protocol responses (docs/contracts.md, "Step protocol")."""

from __future__ import annotations

from pydantic import BaseModel

from wire.assignment import Assignment


class WorkOut(BaseModel):
    assignment: Assignment | None = None


class UploadOut(BaseModel):
    accepted: list[int]
    duplicates: list[int]
