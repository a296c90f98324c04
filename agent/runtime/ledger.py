"""What this device has uploaded, persisted across restarts.

An append-only file of JSON lines `{"job", "step", "shard"}`, appended and fsynced after the
server accepted an upload. A line torn by a kill mid-write is skipped on load. The server's work
list decides what is computed (a shard it accepted is not listed, so a restarted agent does not
upload it twice); a shard listed again although recorded here lost its result on the server (a
replica that held the upload died, Redis restarted) and is computed again, and the agent says so.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path

from agent.config import atomic_write


class UploadLedger:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._done: set[tuple[str, int, int]] = set()
        self._load()

    def _load(self) -> None:
        try:
            raw = self.path.read_bytes()
        except OSError:
            return
        for line in raw.splitlines():
            try:
                rec = json.loads(line)
                self._done.add((str(rec["job"]), int(rec["step"]), int(rec["shard"])))
            except (ValueError, KeyError, TypeError):
                continue
        latest: dict[str, int] = {}
        for job, step, _ in self._done:
            latest[job] = max(step, latest.get(job, step))
        kept = {r for r in self._done if r[1] == latest[r[0]]}
        if len(kept) < len(self._done):  # only the latest step of a job can still be offered
            self._done = kept
            lines = b"".join(json.dumps({"job": j, "step": t, "shard": k}).encode() + b"\n"
                             for j, t, k in sorted(kept))
            atomic_write(self.path, lines)

    def uploaded(self, job: str, step: int, shard: int) -> bool:
        with self._lock:
            return (job, step, shard) in self._done

    def record(self, job: str, step: int, shards: list[int]) -> None:
        lines = b"".join(
            json.dumps({"job": job, "step": step, "shard": k}).encode() + b"\n" for k in shards
        )
        with self._lock:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # a torn tail from a kill would glue onto our first line: start on a fresh line
            prefix = b"\n" if self._tail_is_torn() else b""
            with open(self.path, "ab") as fh:
                fh.write(prefix + lines)
                fh.flush()
                os.fsync(fh.fileno())
            self._done.update((job, step, k) for k in shards)

    def forget_job(self, job: str, keep_from_step: int) -> None:
        """Drop records of finished steps from memory (the file is compacted on next start)."""
        with self._lock:
            self._done = {r for r in self._done if r[0] != job or r[1] >= keep_from_step}

    def _tail_is_torn(self) -> bool:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                if fh.tell() == 0:
                    return False
                fh.seek(-1, os.SEEK_END)
                return fh.read(1) != b"\n"
        except OSError:
            return False
