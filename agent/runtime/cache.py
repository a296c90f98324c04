"""On-disk cache of a job's inputs: weights per step, shard data per (job, shard).

Every file is written atomically; a file that does not parse (damaged some other way) is
deleted and fetched again, so a bad cache never breaks the next start.
"""

from __future__ import annotations

import contextlib
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


class WorkCache:
    def __init__(self, root: Path) -> None:
        self.root = root
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
        return self._get(path, fetch, _valid_npz)

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
