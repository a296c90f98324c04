"""On-disk cache of a job's inputs: weights per step, shard data per (job, shard).

Every file is written atomically; a file that does not parse (damaged some other way) is
deleted and fetched again, so a bad cache never breaks the next start. Shard files are bounded
(`max_shard_bytes`): past it, the least recently used go first (a shard that moved away, a
backup computed once), never one the current step needs; fetched again if they come back.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import shutil
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

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

    def shard(self, job: str, shard: int, fetch: Callable[[int], tuple[bytes, int | None]]
              ) -> Path:
        """The shard's samples, fetched (`fetch(start)`: a chunk and the shard's total) when
        not cached."""
        path = self.job_dir(job) / f"shard-{int(shard)}.npz"
        got = self._get(path, lambda: write_shard(path, fetch), _valid_npz)
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
        # per step and checked by its CRC when read after a restart: no fsync (12-100 MB a step)
        got = self._get(path, lambda: atomic_write(path, fetch(), durable=False),
                        lambda p: _valid_weights(p, job, step))
        for old in path.parent.glob("weights-*.bin"):  # weights are per step: keep the current
            if old != path:
                with contextlib.suppress(OSError):
                    old.unlink()
                    self._checked.discard(old)
        return got

    def result_path(self, job: str, step: int) -> Path:
        return self.job_dir(job) / f"result-{int(step)}.bin"

    def _get(self, path: Path, write: Callable[[], None], valid: Callable[[Path], bool]) -> Path:
        """`path`, valid; else `write` makes it (atomically) and it is checked."""
        if path in self._checked and path.exists():
            return path
        if path.exists() and not valid(path):
            path.unlink()
        if not path.exists():
            clean_temp_files(path)
            write()
            if not valid(path):
                path.unlink()
                raise ValueError(f"server sent unusable data for {path.name}")
        self._checked.add(path)
        return path


def write_shard(path: Path, fetch: Callable[[int], tuple[bytes, int | None]]) -> None:
    """The shard's samples, fetched chunk by chunk, as one .npz at `path` (atomically): x goes
    into its member as each chunk comes (a shard need not fit in memory twice), y and the
    normalization (mean, std) are written at the end."""
    import numpy as np  # the agent's one hard dependency

    first, total = fetch(0)
    x, y, extra = _chunk(first)
    if total is None or len(y) >= total:  # the whole shard in one answer
        atomic_write(path, first)
        return
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        labels, got = [y], len(y)
        with zipfile.ZipFile(tmp, "w") as zf:
            with zf.open("x.npy", "w", force_zip64=True) as member:
                header = {"descr": np.lib.format.dtype_to_descr(x.dtype), "fortran_order": False,
                          "shape": (total, *x.shape[1:])}
                np.lib.format.write_array_header_2_0(member, header)
                member.write(np.ascontiguousarray(x).tobytes())
                while got < total:
                    more, _ = fetch(got)
                    x_more, y_more, _ = _chunk(more)
                    if not len(y_more) or x_more.dtype != x.dtype or \
                            x_more.shape[1:] != x.shape[1:]:
                        raise ValueError(f"server sent an unusable chunk at sample {got}")
                    member.write(np.ascontiguousarray(x_more).tobytes())
                    labels.append(y_more)
                    got += len(y_more)
            if got != total:
                raise ValueError(f"server sent {got} samples of a shard of {total}")
            for name, value in (("y", np.concatenate(labels)), *extra.items()):
                out = io.BytesIO()
                np.save(out, value, allow_pickle=False)
                zf.writestr(f"{name}.npy", out.getvalue())
        os.chmod(tmp, 0o600)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _chunk(body: bytes) -> tuple[Any, Any, dict[str, Any]]:
    import numpy as np

    with np.load(io.BytesIO(body), allow_pickle=False) as npz:
        if "x" not in npz.files or "y" not in npz.files or len(npz["x"]) != len(npz["y"]):
            raise ValueError("server sent a shard chunk without matching x and y")
        return npz["x"], npz["y"], {k: npz[k] for k in ("mean", "std") if k in npz.files}
