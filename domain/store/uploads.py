"""Resumable dataset uploads: a file sent in chunks that survives a dropped connection.

The protocol (docs/api.md): `POST /v1/datasets/uploads {name, size, sha256}` opens an upload;
`PUT /v1/datasets/uploads/{id}?offset=N` appends one chunk that must start where the upload
stands (else 409 naming the offset to resume from); `GET /v1/datasets/uploads/{id}` says where
it stands; `POST /v1/datasets/uploads/{id}/complete` checks the size and the SHA-256, validates
the .npz and stores it as a dataset. The parts live on disk under `<data_dir>/uploads/` (shared
by the replicas, as the datasets are), never whole in a process's memory (completion hashes
and unpacks them in blocks); an upload is its opener's only, and one left alone for UPLOAD_TTL_S is dropped at the next open.

Completing is one request at a time per upload, on every replica (`completing`: a lock on the
upload's record): another complete while one runs is 409, and one after it stored the dataset
is 409 naming it (a record in `completed/` says so for UPLOAD_TTL_S) - never a 500 from parts
removed under it.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from domain.errors import Conflict, Invalid, NotFound, PayloadTooLarge
from domain.store.tokens import Principal

CHUNK_MAX_BYTES = 8 * 1024 * 1024
HASH_BLOCK = 8 * 1024 * 1024
UPLOAD_TTL_S = 24 * 3600
OPEN_PER_OWNER = 4  # uploads one token may have open at once (each may hold the upload limit)
_ID = re.compile(r"^upl-[0-9a-f]{32}\Z")
_SHA256 = re.compile(r"^[0-9a-f]{64}\Z")


@dataclass(frozen=True)
class Upload:
    id: str
    name: str
    size: int
    sha256: str
    owner: str  # the opener's token id
    opened: float

    def answer(self, offset: int) -> dict[str, object]:
        return {"id": self.id, "name": self.name, "size": self.size, "offset": offset,
                "chunk_max_bytes": CHUNK_MAX_BYTES}


def _folder(data_dir: Path) -> Path:
    folder = data_dir / "uploads"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _paths(data_dir: Path, upload_id: str) -> tuple[Path, Path]:
    folder = _folder(data_dir)
    return folder / f"{upload_id}.json", folder / f"{upload_id}.part"


def _done_path(data_dir: Path, upload_id: str) -> Path:
    return _folder(data_dir) / "completed" / f"{upload_id}.json"


def _size(path: Path) -> int:
    """A part's size; 0 once it is gone (a completion may remove it at any moment)."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


def _owns(upload: Upload, principal: Principal) -> bool:
    return upload.owner == (principal.token_id or "admin") or principal.is_admin


def open_upload(data_dir: Path, name: str, size: int, sha256: str, principal: Principal,
                max_bytes: int) -> Upload:
    if size > max_bytes:
        raise PayloadTooLarge(f"a dataset of {size} bytes is over the {max_bytes}-byte limit")
    if not _SHA256.match(sha256):
        raise Invalid("sha256", "the file's SHA-256 as 64 lowercase hex digits")
    drop_stale(data_dir, time.time())
    owner = principal.token_id or "admin"
    if sum(1 for u in _all(data_dir) if u.owner == owner) >= OPEN_PER_OWNER:
        raise Conflict(f"{OPEN_PER_OWNER} uploads are open for this token already: complete "
                       f"one (or leave it {UPLOAD_TTL_S // 3600} h and it is dropped)")
    upload = Upload(f"upl-{uuid.uuid4().hex}", name, size, sha256, owner, time.time())
    meta, part = _paths(data_dir, upload.id)
    part.touch()
    meta.write_text(json.dumps(asdict(upload)))
    return upload


def find(data_dir: Path, upload_id: str, principal: Principal) -> tuple[Upload, int]:
    """The upload and how many bytes it holds; 404 for an unknown id or another's upload."""
    if not _ID.match(upload_id):
        raise NotFound(f"upload {upload_id} not found")
    meta, part = _paths(data_dir, upload_id)
    upload = _read(meta)
    if upload is None or not _owns(upload, principal):
        raise NotFound(f"upload {upload_id} not found")
    return upload, _size(part)


def find_to_complete(data_dir: Path, upload_id: str, principal: Principal) -> Upload:
    """`find`, for a completion: an upload completed already is 409 naming its dataset."""
    try:
        return find(data_dir, upload_id, principal)[0]
    except NotFound:
        raise _finished(data_dir, upload_id, principal) from None


@contextmanager
def completing(data_dir: Path, upload: Upload, principal: Principal) -> Iterator[None]:
    """Hold the upload's completion: one at a time, across threads, processes and replicas
    sharing the data dir (an exclusive lock on its record). 409 at once when another
    completion holds it, and when the upload was completed while this one waited."""
    meta, _ = _paths(data_dir, upload.id)
    try:
        fh = meta.open("rb")
    except FileNotFoundError:
        raise _finished(data_dir, upload.id, principal) from None
    with fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise Conflict(f"upload {upload.id} is being completed by another request: the "
                           f"dataset {upload.name!r} is there once it answers") from None
        if os.fstat(fh.fileno()).st_nlink == 0:  # completed (or dropped) before the lock
            raise _finished(data_dir, upload.id, principal)
        yield


def finish(data_dir: Path, upload: Upload) -> None:
    """The dataset is stored: remember that (a late or repeated complete is told, 409), then
    drop the parts."""
    done = _done_path(data_dir, upload.id)
    done.parent.mkdir(exist_ok=True)
    done.write_text(json.dumps(asdict(upload)))
    close(data_dir, upload.id)


def _finished(data_dir: Path, upload_id: str, principal: Principal) -> Exception:
    """What a complete of an upload no longer open is told: 409 when it was completed (its
    opener only), 404 otherwise (never opened, another's, or refused and dropped)."""
    done = _read(_done_path(data_dir, upload_id)) if _ID.match(upload_id) else None
    if done is not None and _owns(done, principal):
        return Conflict(f"upload {upload_id} was completed already: it is the dataset "
                        f"{done.name!r}")
    return NotFound(f"upload {upload_id} not found")


def append(data_dir: Path, upload: Upload, offset: int, chunk: bytes) -> int:
    """Add `chunk` at `offset` (where the upload stands); the new offset."""
    if len(chunk) > CHUNK_MAX_BYTES:
        raise PayloadTooLarge(f"a chunk is at most {CHUNK_MAX_BYTES} bytes")
    _, part = _paths(data_dir, upload.id)
    with part.open("ab") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)  # two replicas appending at once: one at a time
        at = fh.seek(0, os.SEEK_END)
        if offset != at:
            raise Conflict(f"the upload stands at byte {at}, not {offset}: resume from {at}")
        if at + len(chunk) > upload.size:
            raise PayloadTooLarge(f"the upload was opened for {upload.size} bytes")
        fh.write(chunk)
        fh.flush()
        os.fsync(fh.fileno())
        return at + len(chunk)


def assembled(data_dir: Path, upload: Upload) -> Path:
    """The file's path, once every byte is there and its SHA-256 (read in blocks) is the one
    announced."""
    _, part = _paths(data_dir, upload.id)
    size = _size(part)
    if size != upload.size:
        raise Conflict(f"the upload holds {size} of {upload.size} bytes: send the rest first")
    digest = hashlib.sha256()
    with part.open("rb") as fh:
        while block := fh.read(HASH_BLOCK):
            digest.update(block)
    if digest.hexdigest() != upload.sha256:
        close(data_dir, upload.id)  # cannot be mended by sending more: start again
        raise Invalid("sha256", "the bytes received do not have the SHA-256 announced: "
                      "open a new upload")
    return part


def _read(meta: Path) -> Upload | None:
    try:
        return Upload(**json.loads(meta.read_text()))
    except (OSError, ValueError, TypeError):
        return None


def _all(data_dir: Path) -> list[Upload]:
    return [u for meta in _folder(data_dir).glob("upl-*.json") if (u := _read(meta))]


def close(data_dir: Path, upload_id: str) -> None:
    for path in _paths(data_dir, upload_id):
        path.unlink(missing_ok=True)


def drop_stale(data_dir: Path, now: float) -> None:
    """Drop the uploads nobody added to for UPLOAD_TTL_S (but one being completed), and the
    records of completed ones as old."""
    folder = _folder(data_dir)
    for path in [*folder.glob("upl-*.part"), *folder.glob("completed/upl-*.json")]:
        try:
            if now - path.stat().st_mtime <= UPLOAD_TTL_S:
                continue
            if path.suffix == ".json":
                path.unlink(missing_ok=True)
                continue
            meta, _ = _paths(data_dir, path.stem)
            try:
                fh = meta.open("rb")
            except FileNotFoundError:  # a part without its record
                close(data_dir, path.stem)
                continue
            with fh:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)  # busy: being completed
                close(data_dir, path.stem)
        except OSError:  # gone meanwhile, or being completed (BlockingIOError): left
            pass
