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
        def fetch(start: int) -> tuple[bytes, int | None]:
            fetched.append(k)
            return _npz(100), None  # a server before chunks: the whole shard at once
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
        cache.shard("job-b", k, lambda start: (_npz(10), 10))
    assert cache.evict("job-b", keep={0, 1, 2}) == []
    assert len(list(cache.job_dir("job-b").glob("shard-*"))) == 3


def test_a_shard_fetched_in_chunks_is_one_file_of_its_stored_samples(tmp_path: Path) -> None:
    """Chunks of uint8 samples with their mean and std become one .npz; the engine reads it
    as the float32 the control plane would have sent (engine.stored.normalize)."""
    from engine.runner import shard_arrays
    from engine.stored import normalize

    x = np.random.default_rng(0).integers(0, 256, (23, 3, 4, 4), dtype=np.uint8)
    y = np.arange(23) % 5
    mean = np.full((1, 3, 1, 1), 0.5, np.float32)
    std = np.full((1, 3, 1, 1), 0.25, np.float32)
    asked: list[int] = []

    def fetch(start: int) -> tuple[bytes, int | None]:
        asked.append(start)
        buf = io.BytesIO()
        np.savez(buf, x=x[start : start + 5], y=y[start : start + 5], mean=mean, std=std)
        return buf.getvalue(), len(y)

    path = WorkCache(tmp_path / "cache").shard("job-c", 0, fetch)
    assert asked == [0, 5, 10, 15, 20]
    with np.load(path) as npz:
        assert npz["x"].dtype == np.uint8 and np.array_equal(npz["x"], x)
    xs, ys = shard_arrays(str(path))
    assert np.array_equal(xs, normalize(x, mean, std)) and np.array_equal(ys, y)
    assert not list(path.parent.glob(".*.tmp"))


def test_shipped_log_lines_fit_one_request_newest_first_kept() -> None:
    import json

    from agent.runtime.logring import fitting

    lines = [{"seq": i, "ts": float(i), "level": "INFO", "message": "température ✓ " * 60}
             for i in range(500)]
    kept = fitting(lines, max_bytes=200_000)
    assert kept and kept[-1]["seq"] == 499 and kept == lines[-len(kept):]
    assert len(json.dumps({"lines": kept})) <= 200_000
    assert len(json.dumps({"lines": lines})) > 200_000


# -- a step's files skip the fsync; the CRC catches what a power cut tore -------------------
def _weights_blob(step: int) -> bytes:
    from wire.messages import encode_weights

    rng = np.random.default_rng(step)
    return encode_weights("j", step, rng.standard_normal(5000).astype(np.float32),
                          np.zeros(4, np.float32))


def _count_fsyncs(monkeypatch) -> list[int]:
    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    return synced


def test_a_steps_weights_and_result_are_written_without_fsync_the_config_with(
        tmp_path: Path, monkeypatch) -> None:
    """Each step writes its weights and its result (10-100 MB) to the phone's flash; an fsync
    of each cost ~10 ms a step here (bench/phone_cores.py), more on a phone. The config, which
    nothing can fetch again, is still made durable."""
    from agent.config import AgentConfig, save
    from agent.runtime.worker import Engine, handle
    from tests.agent.step_request import make_request, step_zero
    from wire.messages import decode_results

    synced = _count_fsyncs(monkeypatch)
    blob = _weights_blob(3)
    path = WorkCache(tmp_path / "cache").weights("j", 3, lambda: blob)
    assert path.read_bytes() == blob
    req = make_request(step_zero({"model": {"arch": "mlp"}, "dataset": "digits", "shards": 4,
                                  "global_batch_size": 32, "seed": 0}), tmp_path, 1)
    reply = handle(Engine("numpy"), {**req, "op": "step"})
    assert reply["ok"] and [r.shard for r in decode_results(
        Path(req["out_path"]).read_bytes())] == [1]
    assert synced == []
    save(tmp_path / "config.json", AgentConfig(server="https://x", device_id="d",
                                                   device_token="t"))
    assert synced, "the config must still be fsynced"


def test_a_weights_file_torn_by_a_power_cut_is_fetched_again(tmp_path: Path) -> None:
    blob = _weights_blob(4)
    WorkCache(tmp_path).weights("j", 4, lambda: blob)
    path = WorkCache(tmp_path).job_dir("j") / "weights-4.bin"
    torn = bytearray(path.read_bytes())
    torn[len(torn) // 2 : len(torn) // 2 + 4096] = bytes(4096)  # a page never written
    path.write_bytes(bytes(torn))
    fetched: list[int] = []
    again = WorkCache(tmp_path).weights("j", 4, lambda: fetched.append(1) or blob)  # restart
    assert fetched == [1] and again.read_bytes() == blob
