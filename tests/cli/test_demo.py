"""`phalanx demo` end to end, short form: 3 simulated phones, a small job, the faults, the
summary, and the API's view of the finished job (through --keep-running)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from tests.e2e.cluster import reference_metrics, rel_diff
from tests.support.env import without_settings
from tests.support.server import REPO_ROOT

SMALL_JOB = {
    "name": "digits-mlp-short",
    "model": {"arch": "mlp", "hidden": 64},
    "dataset": "digits",
    "global_batch_size": 128,
    "shards": 8,
    # long enough that, after the faults fire (polled once a second), steps remain for the
    # control plane to move shards: at 5 epochs a fast machine finished first, now and then
    "epochs": 12,
    "seed": 0,
    "eval_every": 10,  # the validation curve, through the faults
    "optimizer": {"lr": 0.1, "momentum": 0.9, "warmup_epochs": 1, "schedule": "cosine"},
    "placement": {"min_devices": 1, "max_devices": 8, "selector": {"rack": "a"},
                  "min_battery": 20, "max_temp_c": 45},
}


class Reader:
    """Collects a child's output in a thread so the test can wait for a line."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines.append(line.rstrip("\n"))

    @property
    def text(self) -> str:
        return "\n".join(self.lines)

    def wait_for(self, pattern: str, proc: subprocess.Popen[str], timeout_s: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = re.search(pattern, self.text)
            if found:
                return found
            if proc.poll() is not None:
                time.sleep(0.5)  # let the reader drain the pipe
                found = re.search(pattern, self.text)
                if found:
                    return found
                pytest.fail(f"demo exited {proc.returncode} before {pattern!r}:\n{self.text[-4000:]}")
            time.sleep(0.5)
        pytest.fail(f"no {pattern!r} within {timeout_s}s:\n{self.text[-4000:]}")


@pytest.mark.slow
def test_demo_trains_through_faults_and_leaves_a_checkpoint(tmp_path: Path) -> None:
    spec = tmp_path / "small.yaml"
    spec.write_text(yaml.safe_dump(SMALL_JOB))
    env = without_settings()
    env.update(PYTHONUNBUFFERED="1", COLUMNS="160")
    cmd = [sys.executable, "-m", "phalanx.cli.main", "demo", "--phones", "3", "--job", str(spec),
           # a long path, as a lab's may be: the lines naming it must not wrap (seen: cut at 140)
           "--data-dir", str(tmp_path / ("a-long-folder-name-" * 4) / "demo"), "--keep-running"]
    # Ctrl-C as at a terminal: a suite started in the background by a non-interactive shell
    # inherits SIGINT ignored, and so would the demo (it then never stopped: seen)
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    out = Reader(proc)
    try:
        out.wait_for(r"admin token: (\S+)", proc, timeout_s=240)
        text = out.text
        url = re.search(r"server: (http://\S+)", text).group(1)  # type: ignore[union-attr]
        token = re.search(r"admin token: (\S+)", text).group(1)  # type: ignore[union-attr]
        acc = float(re.search(r"final validation accuracy: ([\d.]+)%", text).group(1))  # type: ignore[union-attr]
        ckpt = Path(re.search(r"checkpoint: (\S+\.npz)", text).group(1))  # type: ignore[union-attr]

        assert "3 phones Ready" in text
        assert re.search(r"fault: phone-\d .* dies at step \d+", text), text
        assert re.search(r"fault: phone-\d .* cooling fails", text), text
        assert re.search(r"wall time: [\d.]+ s", text)
        assert re.search(r"energy estimate: \d+ J", text)
        report = Path(re.search(r"report \(open it in a browser\): (\S+\.html)", text)
                      .group(1))  # type: ignore[union-attr]
        page = report.read_text()
        assert "Scheduled" in page and "data-series=\"train\"" in page and "data-device=" in page
        assert "data-series=\"joules\"" in page  # the phones' energy, step by step

        headers = {"Authorization": f"Bearer {token}"}
        jobs = httpx.get(f"{url}/v1/jobs", headers=headers, timeout=30).json()["items"]
        assert len(jobs) == 1
        job = jobs[0]
        assert job["state"] == "Succeeded"
        assert job["step"] == job["total_steps"] > 0
        # every step's energy, to the last: the demo waits for the phones' reports past it
        joules = re.search(r'data-series="joules" data-points="(\d+)"', page)
        assert joules and int(joules.group(1)) == job["step"], joules
        # the server's energy, from the phones' telemetry (power every heartbeat, the charging
        # phones not counted), agrees with what the simulated batteries gave: not the chargers'
        # power into the others (several times more), not nothing
        curve = httpx.get(f"{url}/v1/jobs/{job['id']}/metrics", headers=headers,
                          timeout=30).json()["items"]
        measured = sum(point["energy_j"] for point in curve)
        modelled = float(re.search(r"(\d+) J of it by those on their batteries", text).group(1))  # type: ignore[union-attr]
        assert 0.5 * modelled < measured < 1.5 * modelled, (measured, modelled)
        assert job["metrics"]["val_accuracy"] == pytest.approx(acc / 100, abs=1e-4)
        assert acc > 85.0
        reasons = {e["reason"] for e in
                   httpx.get(f"{url}/v1/jobs/{job['id']}/events", headers=headers,
                             timeout=30).json()["items"]}
        assert "ShardsMoved" in reasons, reasons
        # through the faults and the moves, the phones followed the reference trajectory
        ref = reference_metrics(SMALL_JOB, tmp_path / "reference")
        assert rel_diff(job["metrics"]["train_loss"], ref["train_loss"]) < 1e-5, (job, ref)
        # its validation curve is the reference trainer's, point for point, and drawn
        assert [{"step": p["step"], "val_loss": p["val_loss"], "val_accuracy": p["val_accuracy"]}
                for p in curve if p["val_loss"] is not None] == ref["validation"]
        drawn = re.findall(r'data-series="validation" data-points="(\d+)"', page)
        assert drawn == [str(len(ref["validation"]))] * 2, drawn  # the loss and the accuracy

        with np.load(ckpt, allow_pickle=False) as npz:
            assert len(npz.files) > 0
        devices = httpx.get(f"{url}/v1/devices", headers=headers, timeout=30).json()["items"]
        assert len(devices) == 3
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out.text[-3000:]
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/healthz", timeout=5)
