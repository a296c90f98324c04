"""Uploaded datasets: the file under `<data_dir>/datasets/` and its row."""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import func, select, text
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from domain.errors import Conflict, Forbidden, Invalid, NotFound, PayloadTooLarge
from domain.store import owners
from domain.store.models import Dataset, Job
from domain.store.tokens import Principal
from engine.data import NAME_RE, DatasetError
from engine.upload import validate_file
from wire.states import JobState

BUILTIN = ("digits",)
QUOTA_SETTING = "PHALANX_USER_MAX_DATASET_BYTES"


def is_builtin(name: str) -> bool:
    """`digits` and the generated `synthetic…` datasets: every user's, never a row."""
    return name in BUILTIN or name.startswith("synthetic")


def check_name(name: str) -> None:
    if not NAME_RE.match(name):
        raise Invalid("name", "dataset name: 1-64 of A-Z a-z 0-9 _ . -, starting alphanumeric")
    if is_builtin(name):
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
                  *, sha256: str, size: int, principal: Principal,
                  quota: int | None = None) -> Dataset:
    """Claim the name with the row first, then move the unpacked folder into place; the
    caller's commit publishes both. A duplicate name is 409 and moves nothing: of two uploads
    of one name at once, the second waits at the row's insert until the first commits, then
    loses there, before touching the folder. The row is `principal`'s (domain.store.owners); a
    user's datasets together must fit `quota` bytes on disk (413 otherwise, moving nothing)."""
    check_free(session, name)
    path = data_dir / "datasets" / name
    row = Dataset(name=name, path=str(path), n_samples=len(dataset.y_train),
                  input_shape=list(dataset.input_shape), num_classes=dataset.num_classes,
                  sha256=sha256, size_bytes=size, owner=owners.owner_of(principal),
                  public=False, stored_bytes=folder_bytes(staged))
    session.add(row)
    try:
        session.flush()
    except IntegrityError:
        raise Conflict(f"dataset {name!r} already exists") from None
    if quota is not None and row.owner is not None:
        # counted after the insert, under the owner's lock: of two uploads at once, the
        # second counts the first (SQLite: the insert holds the one write lock until commit)
        _lock_owner(session, row.owner)
        check_quota(session, row.owner, quota)
    # a folder or file without a row is a failed earlier upload: replaced
    shutil.rmtree(path, ignore_errors=True)
    legacy = path.with_name(f"{name}.npz")
    if legacy.is_file():
        legacy.unlink()
    os.replace(staged, path)
    return row


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def stated_bytes(source: Path) -> int | None:
    """What the .npz at `source` says its arrays unpack to (its zip directory; the unpacking
    refuses an array that grows past its stated size), or None for a file that is no zip
    (the validation says what is wrong with it)."""
    try:
        with zipfile.ZipFile(source) as archive:
            return sum(info.file_size for info in archive.infolist())
    except (OSError, zipfile.BadZipFile, ValueError):
        return None


def used_bytes(session: Session, owner: str) -> int:
    return int(session.scalar(select(func.coalesce(func.sum(Dataset.stored_bytes), 0))
                              .where(Dataset.owner == owner)) or 0)


def check_quota(session: Session, owner: str, quota: int, adding: int = 0) -> None:
    """413 when `owner`'s datasets (and `adding` more bytes) are over `quota`."""
    used = used_bytes(session, owner)
    if used + adding > quota:
        raise PayloadTooLarge(
            f"your datasets would take {used + adding} bytes on the server, over your "
            f"{quota}-byte quota ({QUOTA_SETTING}); {used} bytes are stored already: "
            "remove some (phalanx datasets rm NAME)")


def check_room(session: Session, principal: Principal, quota: int | None, adding: int) -> None:
    """Before any work: 413 when `adding` bytes cannot fit the user's quota (admins have
    none). The check that counts is `store_dataset`'s, with what was unpacked."""
    if quota is not None and principal.user is not None:
        check_quota(session, principal.user, quota, adding)


def _lock_owner(session: Session, owner: str) -> None:
    """Postgres: one quota check per owner at a time, until the transaction ends."""
    if session.get_bind().dialect.name == "postgresql":
        key = int.from_bytes(hashlib.sha256(f"datasets:{owner}".encode()).digest()[:8], "big",
                             signed=True)
        session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": key})


def list_visible(session: Session, principal: Principal) -> list[Dataset]:
    """The uploaded datasets `principal` may see: an admin every one, a user their own and
    the public ones."""
    return list(session.scalars(select(Dataset).where(owners.visible(Dataset, principal))
                                .order_by(Dataset.name)))


def find(session: Session, name: str, principal: Principal) -> Dataset:
    """An uploaded dataset `principal` may see; 404 for another user's, as for none."""
    return owners.find(session, Dataset, name, principal, f"dataset {name!r}")


def require_usable(session: Session, name: str, principal: Principal) -> None:
    """A job of `principal` may train on `name`: a built-in, or a dataset they may see (404
    otherwise, whether it is another user's or does not exist)."""
    if not is_builtin(name):
        find(session, name, principal)


def delete_dataset(session: Session, name: str, principal: Principal,
                   data_dir: Path) -> tuple[Dataset, Path]:
    """Delete the row and move the folder aside (returned: the caller removes it once the
    transaction committed, so a new upload of the name never loses its folder to this one).
    404 for what they may not see, 403 for a public one that is not theirs, 409 while a job
    that has not finished trains on it."""
    if is_builtin(name):
        raise Forbidden(f"dataset {name!r} is built in: it cannot be removed")
    row = owners.find_to_change(session, Dataset, name, principal, f"dataset {name!r}")
    users = session.scalar(select(func.count()).select_from(Job).where(
        Job.spec["dataset"].as_string() == name,
        Job.state.in_((JobState.PENDING.value, JobState.RUNNING.value))))
    if users:
        raise Conflict(f"dataset {name!r} is used by {users} unfinished job(s): cancel them "
                       "or let them finish first")
    session.delete(row)
    session.flush()
    trash = data_dir / "datasets" / f".{name}.{uuid.uuid4().hex}.removed"
    path = Path(row.path)
    if path.is_dir():
        os.replace(path, trash)
    legacy = data_dir / "datasets" / f"{name}.npz"
    if legacy.is_file():
        legacy.unlink()
    return row, trash


def restore(trash: Path, path: Path) -> None:
    """Put a folder moved aside by `delete_dataset` back (its transaction did not commit)."""
    if trash.is_dir():
        os.replace(trash, path)


def set_public(session: Session, name: str, public: bool) -> Dataset:
    """An admin's act: every user may see and use the dataset (or no longer may)."""
    row = session.get(Dataset, name)
    if row is None:
        raise NotFound(f"dataset {name!r} not found")
    row.public = public
    session.flush()
    return row
