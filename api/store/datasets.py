"""Uploaded datasets: the file under `<data_dir>/datasets/` and its row."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from api.errors import Conflict, Invalid
from api.store.models import Dataset
from engine.data import NAME_RE, DatasetError
from engine.upload import validate_file

BUILTIN = ("digits",)


def check_name(name: str) -> None:
    if not NAME_RE.match(name):
        raise Invalid("name", "dataset name: 1-64 of A-Z a-z 0-9 _ . -, starting alphanumeric")
    if name in BUILTIN or name.startswith("synthetic"):
        raise Conflict(f"dataset name {name!r} is reserved for a built-in dataset")


def check_free(session: Session, name: str) -> None:
    if session.get(Dataset, name) is not None:
        raise Conflict(f"dataset {name!r} already exists")


@contextmanager
def staging(data_dir: Path, name: str) -> Iterator[Path]:
    """A folder to unpack an upload into, beside the datasets (one rename publishes it);
    removed unless `store_dataset` moved it into place."""
    folder = data_dir / "datasets"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f".{name}.{uuid.uuid4().hex}.unpack"  # one per upload, even in one process
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def validate_upload(source: Path, staged: Path, max_bytes: int) -> Any:
    """The .npz at `source` unpacked into `staged` and checked there, block by block."""
    try:
        return validate_file(source, staged, max_bytes)
    except DatasetError as exc:
        raise Invalid("file", str(exc)) from exc


def store_dataset(session: Session, name: str, staged: Path, dataset: Any, data_dir: Path,
                  *, sha256: str, size: int) -> Dataset:
    """Claim the name with the row first, then move the unpacked folder into place; the
    caller's commit publishes both. A duplicate name is 409 and moves nothing: of two uploads
    of one name at once, the second waits at the row's insert until the first commits, then
    loses there, before touching the folder."""
    check_free(session, name)
    path = data_dir / "datasets" / name
    row = Dataset(name=name, path=str(path), n_samples=len(dataset.y_train),
                  input_shape=list(dataset.input_shape), num_classes=dataset.num_classes,
                  sha256=sha256, size_bytes=size)
    session.add(row)
    try:
        session.flush()
    except IntegrityError:
        raise Conflict(f"dataset {name!r} already exists") from None
    # a folder or file without a row is a failed earlier upload: replaced
    shutil.rmtree(path, ignore_errors=True)
    legacy = path.with_name(f"{name}.npz")
    if legacy.is_file():
        legacy.unlink()
    os.replace(staged, path)
    return row


def list_uploaded(session: Session) -> list[Dataset]:
    return list(session.scalars(select(Dataset).order_by(Dataset.name)))
