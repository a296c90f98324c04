"""A dataset bigger than the server should hold: upload it, train on it, watch the server's RSS.

    .venv/bin/python bench/dataset_memory.py [--gib 2] [--agents 2] [--shards 16]

Writes a uint8 image dataset of --gib GiB (3x64x64 samples, 10 classes, with per-channel mean
and std) as an .npz, streamed to disk; starts a `phalanx server` (embedded: SQLite, the
scheduler in-process); uploads the file with the resumable protocol in 8 MiB chunks; submits a
logreg job of one epoch at a large batch (8 steps) and runs real agents (`python -m agent run`,
fixture phones) until it succeeds. The server's resident memory is sampled every 0.2 s
throughout. Target (issue 20 item 4): it grows by less than 200 MiB over its idle size.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from pathlib import Path

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.agent import phone  # noqa: E402
from tests.support.server import free_port  # noqa: E402

ADMIN = "phx-admin-bench-" + "0" * 24
SAMPLE = (3, 64, 64)
CHUNK = 8 << 20


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class Sampler(threading.Thread):
    """The server's RSS every 0.2 s: the peak, and the peak per phase."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.phase, self.peaks = pid, "idle", {}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                value = rss_mb(self.pid)
            except OSError:
                return
            self.peaks[self.phase] = max(self.peaks.get(self.phase, 0.0), value)
            time.sleep(0.2)


def write_dataset(path: Path, gib: float) -> tuple[int, str]:
    """x uint8 (N, 3, 64, 64) streamed into the .npz in blocks, y, mean, std; (N, sha256)."""
    per = int(np.prod(SAMPLE))
    n = int(gib * (1 << 30) // per)
    rng = np.random.default_rng(0)
    y = rng.integers(0, 10, n).astype(np.int64)
    block = max(1, (64 << 20) // per)
    with zipfile.ZipFile(path, "w") as zf:
        with zf.open("x.npy", "w", force_zip64=True) as member:
            np.lib.format.write_array_header_2_0(member, {
                "descr": "|u1", "fortran_order": False, "shape": (n, *SAMPLE)})
            for start in range(0, n, block):
                rows = min(block, n - start)
                noise = rng.integers(0, 128, (rows, *SAMPLE), dtype=np.uint8)
                member.write((noise + (y[start : start + rows] * 12).astype(np.uint8)
                              [:, None, None, None]).tobytes())
        for name, value in (("y", y), ("mean", np.array([0.45, 0.45, 0.45])),
                            ("std", np.array([0.15, 0.15, 0.15]))):
            buf = io.BytesIO()
            np.save(buf, value)
            zf.writestr(f"{name}.npy", buf.getvalue())
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block_bytes := fh.read(CHUNK):
            digest.update(block_bytes)
    return n, digest.hexdigest()


def upload(api: httpx.Client, path: Path, name: str, sha256: str) -> dict:
    size = path.stat().st_size
    up = api.post("/v1/datasets/uploads", json={"name": name, "size": size, "sha256": sha256})
    up.raise_for_status()
    upload_id, offset = up.json()["id"], 0
    started = time.monotonic()
    with path.open("rb") as fh:
        while offset < size:
            chunk = fh.read(CHUNK)
            r = api.put(f"/v1/datasets/uploads/{upload_id}", params={"offset": offset},
                        content=chunk)
            r.raise_for_status()
            offset = r.json()["offset"]
            if offset % (256 << 20) < CHUNK:
                print(f"  uploaded {offset / (1 << 30):.2f} of {size / (1 << 30):.2f} GiB "
                      f"({time.monotonic() - started:.0f} s)", flush=True)
    done = api.post(f"/v1/datasets/uploads/{upload_id}/complete", timeout=1800)
    done.raise_for_status()
    return done.json()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--agents", type=int, default=2)
    ap.add_argument("--shards", type=int, default=16)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="phalanx-dsmem-"))
    data = root / "images.npz"
    t0 = time.monotonic()
    n, sha = write_dataset(data, args.gib)
    print(f"dataset: {n:,} samples of {SAMPLE}, {data.stat().st_size / (1 << 30):.2f} GiB "
          f"({time.monotonic() - t0:.0f} s)", flush=True)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")}
    env.update(PHALANX_DATABASE_URL=f"sqlite:///{root}/phalanx.sqlite",
               PHALANX_DATA_DIR=str(root / "data"), PHALANX_ADMIN_TOKEN=ADMIN,
               PHALANX_HEARTBEAT_INTERVAL_S="1", PHALANX_RECONCILE_INTERVAL_S="1",
               PYTHONUNBUFFERED="1")
    log = (root / "server.log").open("wb")
    server = subprocess.Popen([sys.executable, "-m", "phalanx.cli.main", "server", "--host",
                               "127.0.0.1", "--port", str(port)], cwd=REPO, env=env,
                              stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    agents: list[subprocess.Popen] = []
    api = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=120)
    try:
        for _ in range(300):
            try:
                if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        api.get("/v1/datasets").raise_for_status()  # the routes' first use, before the baseline
        time.sleep(2)
        idle = rss_mb(server.pid)
        sampler = Sampler(server.pid)
        sampler.start()
        sampler.phase = "upload"
        t0 = time.monotonic()
        stored = upload(api, data, "images", sha)
        upload_s = time.monotonic() - t0
        print(f"uploaded and stored: {stored['n_train']:,} samples ({upload_s:.0f} s)",
              flush=True)
        sampler.phase = "train"
        tree = phone.build_tree(root / "phone")
        for zone in ("thermal_zone0", "thermal_zone1"):
            phone.set_value(tree, f"/sys/class/thermal/{zone}/temp", 40000)
        agent_env = env | {"PYTHONPATH": str(REPO), "PHALANX_SYSFS_ROOT": str(tree)}
        for i in range(args.agents):
            token = api.post("/v1/enrollment-tokens", json={}).json()["token"]
            config = root / f"agent-{i}" / "config.json"
            subprocess.run([sys.executable, "-m", "agent", "enroll", "--server", url,
                            "--token", token, "--name", f"bench-{i}", "--config", str(config)],
                           cwd=REPO, env=agent_env, check=True, capture_output=True)
            cfg = json.loads(config.read_text())
            cfg.update(backends=["numpy"], cache_max_shard_bytes=8 << 30, work_wait_s=5.0)
            config.write_text(json.dumps(cfg))
            agents.append(subprocess.Popen(
                [sys.executable, "-m", "agent", "run", "--config", str(config)], cwd=REPO,
                env=agent_env, stdout=(root / f"agent-{i}.log").open("wb"),
                stderr=subprocess.STDOUT))
        batch = (stored["n_train"] // 8) // args.shards * args.shards
        spec = {"name": "big-images", "model": {"arch": "logreg"}, "dataset": "images",
                "global_batch_size": batch, "shards": args.shards, "epochs": 1, "seed": 0,
                "placement": {"min_devices": args.agents, "max_devices": args.agents}}
        job = api.post("/v1/jobs", json=spec)
        job.raise_for_status()
        job_id, t0 = job.json()["id"], time.monotonic()
        while True:
            state = api.get(f"/v1/jobs/{job_id}").json()
            if state["state"] in ("Succeeded", "Failed", "Cancelled"):
                break
            time.sleep(2)
        train_s = time.monotonic() - t0
        sampler.stop.set()
        sampler.join()
        peaks = sampler.peaks
        worst = max(peaks.get("upload", idle), peaks.get("train", idle))
        print(json.dumps({"job": state["state"], "steps": state["step"],
                          "train_loss": (state.get("metrics") or {}).get("train_loss")}))
        print(f"\nserver RSS idle {idle:.0f} MB; peak while uploading "
              f"{peaks.get('upload', 0):.0f} MB, while training {peaks.get('train', 0):.0f} "
              f"MB; growth {worst - idle:.0f} MB (target < 200 MB: "
              f"{'met' if worst - idle < 200 else 'NOT met'})")
        print(f"upload {upload_s:.0f} s ({data.stat().st_size / (1 << 20) / upload_s:.0f} "
              f"MB/s), training {train_s:.0f} s for {state['step']} steps on {args.agents} "
              f"agents")
    finally:
        for proc in agents:
            proc.terminate()
        server.terminate()
        for proc in [*agents, server]:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        print(f"(logs and data in {root}; remove it when done)")


if __name__ == "__main__":
    main()
