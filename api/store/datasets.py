"""Uploaded datasets: the file under `<data_dir>/datasets/` and its row."""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api.errors import Conflict, Invalid
from api.store.models import Dataset
from engine.data import NAME_RE, DatasetError, validate_npz

BUILTIN = ("digits",)


def check_name(name: str) -> None:
    if not NAME_RE.match(name):
        raise Invalid("name", "dataset name: 1-64 of A-Z a-z 0-9 _ . -, starting alphanumeric")
    if name in BUILTIN or name.startswith("synthetic"):
        raise Conflict(f"dataset name {name!r} is reserved for a built-in dataset")


def check_free(session: Session, name: str) -> None:
    if session.get(Dataset, name) is not None:
        raise Conflict(f"dataset {name!r} already exists")


def validate_upload(data: bytes, max_bytes: int) -> Any:
    try:
        return validate_npz(data, max_bytes)
    except DatasetError as exc:
        raise Invalid("file", str(exc)) from exc


def store_dataset(session: Session, name: str, data: bytes, dataset: Any, data_dir: Path
                  ) -> Dataset:
    """Claim the name with the row first, then write the file atomically; the caller's commit
    publishes both. A duplicate name is 409 and writes nothing: of two uploads of one name at
    once, the second waits at the row's insert until the first commits, then loses there,
    before touching the file."""
    check_free(session, name)
    folder = data_dir / "datasets"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.npz"  # a file without a row is a failed earlier upload: replaced
    row = Dataset(name=name, path=str(path), n_samples=len(dataset.y_train),
                  input_shape=list(dataset.input_shape), num_classes=dataset.num_classes,
                  sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data))
    session.add(row)
    try:
        session.flush()
    except IntegrityError:
        raise Conflict(f"dataset {name!r} already exists") from None
    tmp = folder / f".{name}.{uuid.uuid4().hex}.tmp"  # one per upload, even in one process
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return row


def list_uploaded(session: Session) -> list[Dataset]:
    return list(session.scalars(select(Dataset).order_by(Dataset.name)))
