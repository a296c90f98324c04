"""On-disk cache of a job's inputs: weights per step, shard data per (job, shard).

Every file is written atomically; a file that does not parse (damaged some other way) is
deleted and fetched again, so a bad cache never breaks the next start. Shard files are bounded
(`max_shard_bytes`): past it, the least recently used go first (a shard that moved away, a
backup computed once), never one the current step needs; fetched again if they come back.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from agent.config import atomic_write, clean_temp_files


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:120]


def _valid_npz(path: Path) -> bool:
    import numpy as np  # the agent's one hard dependency

    try:
        with np.load(path, allow_pickle=False) as npz:
            return "x" in npz.files and "y" in npz.files and len(npz["x"]) == len(npz["y"])
    except Exception:  # zipfile/ValueError/OSError: any damage means fetch again
        return False


def _valid_weights(path: Path, job: str, step: int) -> bool:
    from wire.messages import WireError, decode_weights

    try:
        decode_weights(path.read_bytes(), expect_job=job, expect_step=step)
    except (WireError, OSError, ValueError):
        return False
    return True


DEFAULT_MAX_SHARD_BYTES = 2 << 30  # a phone's flash is shared with its owner's photos


class WorkCache:
    def __init__(self, root: Path, max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> None:
        self.root = root
        self.max_shard_bytes = max_shard_bytes
        self._checked: set[Path] = set()

    def job_dir(self, job: str) -> Path:
        return self.root / _safe(job)

    def keep_only(self, job: str) -> None:
        """A device holds one job at a time: drop every other job's files."""
        keep = self.job_dir(job).name
        if self.root.is_dir():
            for entry in self.root.iterdir():
                if entry.name != keep:
                    shutil.rmtree(entry, ignore_errors=True)

    def shard(self, job: str, shard: int, fetch: Callable[[], bytes]) -> Path:
        path = self.job_dir(job) / f"shard-{int(shard)}.npz"
        got = self._get(path, fetch, _valid_npz)
        with contextlib.suppress(OSError):
            os.utime(got)  # used now: the eviction order is the order of use
        return got

    def evict(self, job: str, keep: set[int]) -> list[int]:
        """Drop the least recently used shard files of `job` until they fit `max_shard_bytes`,
        never one in `keep` (the step's own); the shards dropped."""
        files = []
        for path in self.job_dir(job).glob("shard-*.npz"):
            with contextlib.suppress(OSError, ValueError):
                stat = path.stat()
                files.append((stat.st_mtime, int(path.stem.split("-")[1]), stat.st_size, path))
        total = sum(size for _, _, size, _ in files)
        dropped = []
        for _, shard, size, path in sorted(files):
            if total <= self.max_shard_bytes:
                break
            if shard in keep:
                continue
            with contextlib.suppress(OSError):
                path.unlink()
                self._checked.discard(path)
                total -= size
                dropped.append(shard)
        return dropped

    def weights(self, job: str, step: int, fetch: Callable[[], bytes]) -> Path:
        path = self.job_dir(job) / f"weights-{int(step)}.bin"
        got = self._get(path, fetch, lambda p: _valid_weights(p, job, step))
        for old in path.parent.glob("weights-*.bin"):  # weights are per step: keep the current
            if old != path:
                with contextlib.suppress(OSError):
                    old.unlink()
                    self._checked.discard(old)
        return got

    def result_path(self, job: str, step: int) -> Path:
        return self.job_dir(job) / f"result-{int(step)}.bin"

    def _get(self, path: Path, fetch: Callable[[], bytes], valid: Callable[[Path], bool]) -> Path:
        if path in self._checked and path.exists():
            return path
        if path.exists() and not valid(path):
            path.unlink()
        if not path.exists():
            clean_temp_files(path)
            atomic_write(path, fetch())
            if not valid(path):
                path.unlink()
                raise ValueError(f"server sent unusable data for {path.name}")
        self._checked.add(path)
        return path
