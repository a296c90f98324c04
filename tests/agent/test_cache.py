"""The phone's on-disk cache of shard data is bounded: least recently used first, never a shard
the current step needs, and a dropped shard is fetched again when it comes back."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np

from agent.runtime.cache import WorkCache


def _npz(n: int) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, x=np.zeros((n, 1, 8, 8), np.float32), y=np.zeros(n, np.int64))
    return buf.getvalue()


def test_shard_files_are_bounded_least_recently_used_first(tmp_path: Path) -> None:
    one = len(_npz(100))
    cache = WorkCache(tmp_path / "cache", max_shard_bytes=3 * one)
    fetched: list[int] = []

    def get(k: int) -> Path:
        def fetch() -> bytes:
            fetched.append(k)
            return _npz(100)
        return cache.shard("job-a", k, fetch)

    for k, when in zip(range(4), (100, 200, 300, 400)):
        os.utime(get(k), (when, when))  # used in this order, long ago
    get(0)  # used again just now: the most recent
    assert cache.evict("job-a", keep={1}) == [2]  # 1 is needed now; 2 is the oldest other
    on_disk = sorted(int(p.stem.split("-")[1]) for p in cache.job_dir("job-a").glob("shard-*"))
    assert on_disk == [0, 1, 3]
    assert fetched == [0, 1, 2, 3]
    get(2)  # back again: fetched, not lost
    assert fetched == [0, 1, 2, 3, 2]


def test_the_shards_a_step_needs_stay_even_past_the_bound(tmp_path: Path) -> None:
    cache = WorkCache(tmp_path / "cache", max_shard_bytes=1)
    for k in range(3):
        cache.shard("job-b", k, lambda: _npz(10))
    assert cache.evict("job-b", keep={0, 1, 2}) == []
    assert len(list(cache.job_dir("job-b").glob("shard-*"))) == 3


def test_shipped_log_lines_fit_one_request_newest_first_kept() -> None:
    import json

    from agent.runtime.logring import fitting

    lines = [{"seq": i, "ts": float(i), "level": "INFO", "message": "température ✓ " * 60}
             for i in range(500)]
    kept = fitting(lines, max_bytes=200_000)
    assert kept and kept[-1]["seq"] == 499 and kept == lines[-len(kept):]
    assert len(json.dumps({"lines": kept})) <= 200_000
    assert len(json.dumps({"lines": lines})) > 200_000
