"""Datasets: reads, an admin's change (sharing), and the resumable upload's messages."""

from __future__ import annotations

import datetime as dt

from pydantic import BaseModel, Field

from api.schemas.common import RequestModel


class DatasetRead(BaseModel):
    name: str
    builtin: bool
    n_train: int | None = None
    n_val: int | None = None
    input_shape: list[int] | None = None
    num_classes: int | None = None
    size_bytes: int | None = None
    sha256: str | None = None
    created: dt.datetime | None = None
    owner: str | None = Field(None, description="the user token id that uploaded it; null for "
                              "a built-in, an admin's, or (to a user) another user's public one")
    public: bool = Field(True, description="every user may see and use it (built-ins; uploads "
                         "an admin shared)")
    stored_bytes: int | None = Field(None, description="what it takes on the server's disk, "
                                     "unpacked: what the per-user quota counts")


class DatasetPatch(RequestModel):
    public: bool = Field(description="true: every user may see and train on the dataset; "
                         "false: its owner (and admins) only")


class UploadOpen(RequestModel):
    name: str = Field(min_length=1, max_length=64, description="the dataset's name")
    size: int = Field(ge=1, description="the file's size in bytes")
    sha256: str = Field(description="the file's SHA-256, 64 lowercase hex digits; checked at "
                        "completion")


class UploadRead(BaseModel):
    id: str
    name: str
    size: int
    offset: int = Field(description="bytes received: where the next chunk starts")
    chunk_max_bytes: int
