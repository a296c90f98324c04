"""A dataset costs the server memory in proportion to a chunk, never to its sample count
(issue 42 item 3: a 38 KiB upload of 2e7 zeros grew a server by ~330 MB, kept).

A real `phalanx server` (embedded: SQLite, the scheduler in-process) takes an .npz of 2e7
uint8 zeros of shape (n, 1) with 0/1 labels, deflated to a few dozen KiB; then a dry run and a
submitted job on it; then a phone that holds one of its shards fetches that shard's samples a
chunk at a time, as the agent does. The server's resident memory stays within 100 MB of what it
was before (its peak, read from the kernel's high-water mark, reset after warming up on a small
dataset). `bench/dataset_hostile_memory.py` runs the same and prints each phase's growth.
"""

from __future__ import annotations

import hashlib
import io
import threading
import time
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.support.databases import migrated_sqlite
from tests.support.env import ADMIN_TOKEN
from tests.support.server import LiveServer, start_server

SAMPLES = 20_000_000
LIMIT_MB = 100.0
SERVER_ENV = {"PHALANX_HEARTBEAT_INTERVAL_S": "1", "PHALANX_RECONCILE_INTERVAL_S": "0.5",
              "PHALANX_LEASE_GRACE_S": "30"}


# -- the dataset ----------------------------------------------------------------------------------

def write_zeros_npz(path: Path, n: int, block: int = 1 << 22) -> None:
    """x: n uint8 zeros of shape (n, 1); y: alternating 0/1 uint8 labels; both deflated,
    streamed into the archive (the test process holds a block, not the arrays)."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as zf:
        for name, shape, fill in (("x", (n, 1), lambda a, b: np.zeros((b - a, 1), np.uint8)),
                                  ("y", (n,), lambda a, b: (np.arange(a, b) % 2).astype(np.uint8))):
            with zf.open(f"{name}.npy", "w", force_zip64=True) as member:
                np.lib.format.write_array_header_1_0(member, {
                    "descr": "|u1", "fortran_order": False, "shape": shape})
                for start in range(0, n, block):
                    member.write(fill(start, min(start + block, n)).tobytes())


def small_npz() -> bytes:
    buf = io.BytesIO()
    np.savez_compressed(buf, x=np.zeros((4000, 1), np.uint8), y=np.arange(4000) % 2)
    return buf.getvalue()


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


# -- the server's memory --------------------------------------------------------------------------

def _status(pid: int, key: str) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith(f"{key}:"):
                return int(line.split()[1]) / 1024
    raise KeyError(key)


class Rss(threading.Thread):
    """A process's resident memory (MB): now, and the peak of each phase, from the kernel's
    high-water mark (VmHWM, reset through clear_refs at each phase) where it may be reset, and
    from samples every 20 ms in any case."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.phase, self.peaks = pid, "", {}
        self.stopping = threading.Event()
        self.lock = threading.Lock()
        self.hwm_resets = self._reset_hwm()

    def now(self) -> float:
        return _status(self.pid, "VmRSS")

    def _reset_hwm(self) -> bool:
        try:
            with open(f"/proc/{self.pid}/clear_refs", "w") as fh:
                fh.write("5")  # resets the peak resident set size (Linux >= 4.0)
            return True
        except OSError:
            return False

    def _note(self, value: float) -> None:
        with self.lock:
            if self.phase:
                self.peaks[self.phase] = max(self.peaks.get(self.phase, 0.0), value)

    def start_phase(self, phase: str) -> None:
        self.end_phase()
        with self.lock:
            self.phase = phase
        self.hwm_resets = self._reset_hwm()
        self._note(self.now())

    def end_phase(self) -> None:
        if self.phase:
            self._note(self.now())
            if self.hwm_resets:
                self._note(_status(self.pid, "VmHWM"))

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                self._note(self.now())
            except OSError:
                return
            time.sleep(0.02)


# -- a phone that only fetches its shard ----------------------------------------------------------

@dataclass
class Phone:
    device_id: str
    token: str
    label: str
    beats: threading.Event = field(default_factory=threading.Event)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}


def enroll(server: LiveServer, api: httpx.Client, label: str) -> Phone:
    from tests.scheduler.helpers import capabilities

    token = api.post("/v1/enrollment-tokens", json={}).json()["token"]
    reg = httpx.post(f"{server.url}/v1/devices/register", timeout=30, json={
        "enrollment_token": token, "name": label, "labels": {"phone": label}})
    assert reg.status_code == 201, reg.text
    phone = Phone(reg.json()["device_id"], reg.json()["device_token"], label)
    caps = capabilities()

    def beat() -> None:  # Ready while the test runs
        with httpx.Client(base_url=server.url, headers=phone.headers(), timeout=30) as http:
            while not phone.beats.is_set():
                http.post(f"/v1/devices/{phone.device_id}/heartbeat",
                          json={"telemetry": [], "capabilities": caps})
                phone.beats.wait(0.5)

    threading.Thread(target=beat, daemon=True).start()
    return phone


def spec(dataset: str, phone: Phone, shards: int) -> dict[str, Any]:
    return {"name": f"mem-{dataset}", "model": {"arch": "logreg"}, "dataset": dataset,
            "global_batch_size": 64 * shards, "shards": shards, "epochs": 1,
            "placement": {"min_devices": 1, "max_devices": 1,
                          "selector": {"phone": phone.label}}}


def fetch_shard(server: LiveServer, phone: Phone, job_id: str, timeout_s: float = 60
                ) -> tuple[int, int]:
    """The phone's first shard of the job, asked for in chunks from start=0 as the agent asks
    (raw: as stored): (samples, chunks)."""
    with httpx.Client(base_url=server.url, headers=phone.headers(), timeout=120) as http:
        deadline, shards = time.monotonic() + timeout_s, []
        while not shards:
            assert time.monotonic() < deadline, f"job {job_id} was never placed"
            work = http.get(f"/v1/devices/{phone.device_id}/work", params={"wait": 2})
            if work.status_code == 200 and work.content:
                a = work.json().get("assignment") or {}
                shards = a.get("shards", []) if a.get("job_id") == job_id else []
        start, total, chunks = 0, None, 0
        while total is None or start < total:
            got = http.get(f"/v1/jobs/{job_id}/shards/{shards[0]}/data",
                           params={"start": start, "encoding": "raw"})
            assert got.status_code == 200, got.text
            total = int(got.headers["X-Phalanx-Shard-Samples"])
            with np.load(io.BytesIO(got.content), allow_pickle=False) as arrays:
                got_y = len(arrays["y"])
            assert got_y > 0
            start, chunks = start + got_y, chunks + 1
        return start, chunks


# -- the run --------------------------------------------------------------------------------------

def upload_post(api: httpx.Client, name: str, path: Path) -> httpx.Response:
    return api.post("/v1/datasets", data={"name": name}, timeout=600,
                    files={"file": (f"{name}.npz", path.read_bytes(), "application/octet-stream")})


def upload_resumable(api: httpx.Client, name: str, path: Path) -> httpx.Response:
    size, chunk = path.stat().st_size, 1 << 20
    up = api.post("/v1/datasets/uploads", json={"name": name, "size": size,
                                                "sha256": sha256_of(path)})
    assert up.status_code == 201, up.text
    upload_id, offset = up.json()["id"], 0
    with path.open("rb") as fh:
        while offset < size:
            fh.seek(offset)
            r = api.put(f"/v1/datasets/uploads/{upload_id}", params={"offset": offset},
                        content=fh.read(chunk))
            assert r.status_code == 200, r.text
            offset = r.json()["offset"]
    return api.post(f"/v1/datasets/uploads/{upload_id}/complete", timeout=600)


@contextmanager
def live(root: Path) -> Iterator[LiveServer]:
    root.mkdir(parents=True, exist_ok=True)
    server = start_server(database_url=migrated_sqlite(root / "phalanx.sqlite"),
                          data_dir=root / "data", admin_token=ADMIN_TOKEN, extra_env=SERVER_ENV)
    try:
        yield server
    finally:
        server.stop()


def measure(server: LiveServer, npz: Path, name: str, shards: int,
            upload: Callable[[httpx.Client, str, Path], httpx.Response] = upload_post,
            say: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Warm the server up on a small dataset (every phase once), then upload `npz` as `name`,
    dry-run and submit a job on it and fetch one shard: each phase's peak over the warm
    server's resident memory (MB), and what is still held at the end."""
    api = server.client()
    api.timeout = httpx.Timeout(120)
    warm_phone, phone = enroll(server, api, f"warm-{name}"), enroll(server, api, name)
    try:
        assert upload(api, f"small-{name}", _small_file(npz.parent)).status_code == 201
        warm = api.post("/v1/jobs", json=spec(f"small-{name}", warm_phone, 2))
        assert warm.status_code == 201, warm.text
        assert api.post("/v1/jobs", params={"dry_run": "true"},
                        json=spec(f"small-{name}", warm_phone, 2)).status_code == 200
        fetch_shard(server, warm_phone, warm.json()["id"])
        time.sleep(1.0)
        rss = Rss(server.process.pid)
        base = rss.now()
        rss.start()
        timings = {}
        rss.start_phase("upload")
        t0 = time.monotonic()
        stored = upload(api, name, npz)
        assert stored.status_code == 201, stored.text
        timings["upload"] = time.monotonic() - t0
        say(f"uploaded {stored.json()['n_train']:,} training samples "
            f"({timings['upload']:.1f} s)")
        rss.start_phase("dry run")
        t0 = time.monotonic()
        dry = api.post("/v1/jobs", params={"dry_run": "true"}, json=spec(name, phone, shards))
        assert dry.status_code == 200, dry.text
        job = api.post("/v1/jobs", json=spec(name, phone, shards))
        assert job.status_code == 201, job.text
        timings["dry run"] = time.monotonic() - t0
        rss.start_phase("shard build")
        t0 = time.monotonic()
        samples, chunks = fetch_shard(server, phone, job.json()["id"])
        timings["shard build"] = time.monotonic() - t0
        say(f"fetched a shard of {samples:,} samples in {chunks} chunks "
            f"({timings['shard build']:.1f} s)")
        rss.end_phase()
        rss.stopping.set()
        rss.join()
        held = rss.now()
        return {"base_mb": base, "hwm_reset": rss.hwm_resets,
                "growth_mb": {phase: peak - base for phase, peak in rss.peaks.items()},
                "held_mb": held - base, "seconds": timings, "n_train": stored.json()["n_train"],
                "shard_samples": samples, "chunks": chunks}
    finally:
        warm_phone.beats.set()
        phone.beats.set()
        api.close()


def _small_file(folder: Path) -> Path:
    path = folder / "small.npz"
    if not path.exists():
        path.write_bytes(small_npz())
    return path


@pytest.fixture(scope="module")
def zeros_npz(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("zeros") / "zeros.npz"
    write_zeros_npz(path, SAMPLES)
    return path


def test_the_hostile_upload_is_a_few_dozen_kib(zeros_npz: Path) -> None:
    assert zeros_npz.stat().st_size < 100 << 10


@pytest.mark.parametrize("upload", [upload_post, upload_resumable], ids=["post", "resumable"])
def test_twenty_million_samples_cost_the_server_under_100_mb_through_upload_dry_run_and_a_shard(
        tmp_path: Path, zeros_npz: Path, upload: Callable[..., httpx.Response]) -> None:
    with live(tmp_path) as server:
        got = measure(server, zeros_npz, "zeros", shards=4, upload=upload)
    assert got["n_train"] == SAMPLES - SAMPLES // 5
    assert got["shard_samples"] == got["n_train"] // 4 and got["chunks"] > 1
    assert set(got["growth_mb"]) == {"upload", "dry run", "shard build"}
    print(got)
    worst = max(got["growth_mb"].values())
    assert worst < LIMIT_MB, got
    assert got["held_mb"] < LIMIT_MB, got
