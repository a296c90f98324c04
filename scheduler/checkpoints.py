"""Checkpoints: `<data_dir>/artifacts/<job>/step-<t>.npz` (named arrays, engine.checkpoint)."""

from __future__ import annotations

import hashlib
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import select
from sqlalchemy.orm import Session

from domain.store.models import Checkpoint
from engine.checkpoint import load_npz, save_npz, state_from_arrays, state_to_arrays
from engine.graph import Model
from engine.step import TrainState


@dataclass(frozen=True)
class WrittenCheckpoint:
    step: int
    path: str
    sha256: str
    size_bytes: int

    def row(self, job_id: str) -> Checkpoint:
        return Checkpoint(job_id=job_id, step=self.step, path=self.path, sha256=self.sha256,
                          size_bytes=self.size_bytes)


def checkpoint_path(artifacts_dir: Path, job_id: str, step: int) -> Path:
    return artifacts_dir / job_id / f"step-{step}.npz"


def write_checkpoint(artifacts_dir: Path, job_id: str, model: Model, state: TrainState) -> WrittenCheckpoint:
    """Write atomically (temp file + rename): a reader never sees half a checkpoint, and a write
    that fails (a full disk) leaves nothing behind and raises OSError."""
    data = save_npz(state_to_arrays(model, state))
    path = checkpoint_path(artifacts_dir, job_id, state.step)
    path.parent.mkdir(parents=True, exist_ok=True)
    # unique across processes and pods (pids repeat across containers sharing the volume)
    tmp = path.with_suffix(f".tmp-{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except OSError:  # a full disk: leave no half-written file behind
        tmp.unlink(missing_ok=True)
        raise
    return WrittenCheckpoint(state.step, str(path), hashlib.sha256(data).hexdigest(), len(data))


def latest_checkpoint(session: Session, job_id: str, at_most: int) -> Checkpoint | None:
    return session.scalars(
        select(Checkpoint)
        .where(Checkpoint.job_id == job_id, Checkpoint.step <= at_most)
        .order_by(Checkpoint.step.desc(), Checkpoint.id.desc())
        .limit(1)
    ).first()


def read_checkpoint(row: Checkpoint, model: Model) -> TrainState | None:
    """The state in a checkpoint file, or None when the file is gone or does not match."""
    try:
        data = Path(row.path).read_bytes()
    except OSError:
        return None
    if hashlib.sha256(data).hexdigest() != row.sha256:
        return None
    try:
        return state_from_arrays(model, load_npz(data))
    except (ValueError, KeyError, OSError):
        return None


def prune_checkpoints(session: Session, job_id: str, keep: int) -> list[str]:
    """Delete all but the `keep` newest checkpoint rows of a job; returns their files' paths
    for the caller to remove once the deletion is committed (a row never points at a file
    already gone because of this)."""
    old = session.scalars(
        select(Checkpoint).where(Checkpoint.job_id == job_id)
        .order_by(Checkpoint.step.desc(), Checkpoint.id.desc()).offset(keep)
    ).all()
    paths = [row.path for row in old]
    for row in old:
        session.delete(row)
    return paths


def drop_checkpoints_after(session: Session, job_id: str, step: int) -> list[str]:
    """Delete a job's checkpoint rows of steps after `step` (a rewind undid them); returns
    their files' paths for the caller to remove once the deletion is committed."""
    later = session.scalars(select(Checkpoint).where(Checkpoint.job_id == job_id,
                                                     Checkpoint.step > step)).all()
    paths = [row.path for row in later]
    for row in later:
        session.delete(row)
    return paths


def checkpoint_steps(session: Session, job_id: str) -> list[int]:
    return list(session.scalars(select(Checkpoint.step).where(Checkpoint.job_id == job_id)))


def remove_files(paths: list[str]) -> None:
    for path in paths:
        Path(path).unlink(missing_ok=True)
