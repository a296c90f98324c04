"""Resumable uploads' completion lock (domain/store/uploads.py, issue 42 item 8), without a
server: a second completion is 409 at once, one after it is 409 naming the dataset (the
opener's only), and dropping stale uploads leaves one being completed alone."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from domain.errors import Conflict, NotFound
from domain.store import uploads
from domain.store.tokens import Principal

ALICE = Principal(kind="user", token_id="tok-alice")
BOB = Principal(kind="user", token_id="tok-bob")


def _opened(data_dir: Path, name: str = "d") -> uploads.Upload:
    upload = uploads.open_upload(data_dir, name, 3, "0" * 64, ALICE, 1 << 20)
    uploads.append(data_dir, upload, 0, b"abc")
    return upload


def _age(data_dir: Path, upload_id: str, seconds: float) -> None:
    past = time.time() - seconds
    for path in (data_dir / "uploads").rglob(f"{upload_id}*"):
        os.utime(path, (past, past))


def test_one_completion_at_a_time_then_409_naming_the_dataset(tmp_path: Path) -> None:
    upload = _opened(tmp_path)
    with uploads.completing(tmp_path, upload, ALICE):
        with pytest.raises(Conflict, match="being completed by another request"):
            with uploads.completing(tmp_path, upload, ALICE):
                pass
        uploads.finish(tmp_path, upload)
    with pytest.raises(Conflict, match="it is the dataset 'd'"):
        uploads.find_to_complete(tmp_path, upload.id, ALICE)
    with pytest.raises(NotFound):  # the record is its opener's only
        uploads.find_to_complete(tmp_path, upload.id, BOB)
    with pytest.raises(Conflict, match="completed already"):  # held open before it finished
        with uploads.completing(tmp_path, upload, ALICE):
            pass


def test_stale_uploads_go_but_not_one_being_completed(tmp_path: Path) -> None:
    busy, idle, done = _opened(tmp_path, "busy"), _opened(tmp_path, "idle"), _opened(tmp_path)
    uploads.finish(tmp_path, done)
    for upload in (busy, idle, done):
        _age(tmp_path, upload.id, uploads.UPLOAD_TTL_S + 60)
    with uploads.completing(tmp_path, busy, ALICE):
        uploads.drop_stale(tmp_path, time.time())
        assert uploads.find(tmp_path, busy.id, ALICE)[1] == 3  # still all there
    with pytest.raises(NotFound):
        uploads.find(tmp_path, idle.id, ALICE)
    with pytest.raises(NotFound):  # the completed record went too, once as old
        uploads.find_to_complete(tmp_path, done.id, ALICE)
