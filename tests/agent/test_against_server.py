"""The real agent against the real `phalanx server` (embedded mode, SQLite, in-process Celery):
enroll, heartbeat, NotReady after a SIGKILL, Ready after a restart, stop on a revoked device,
and training a job end to end."""

from __future__ import annotations

import io
import json
import os
import platform
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from engine.compute_class import fingerprint
from phalanx.train_local import run_reference
from tests.agent import live, phone
from tests.agent.helpers import REPO, agent_process
from tests.agent.live import ADMIN_TOKEN, SERVER_ENV, live_server
from tests.support.databases import migrated_sqlite
from tests.support.server import LiveServer, start_server
from tests.support.waiting import wait_for


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    yield from live_server(tmp_path_factory.mktemp("server"))


def enroll(server: LiveServer, home: Path, root: Path, *labels: str) -> str:
    """The enrolled phone's device id; its config is `home`/config.json."""
    p = live.enroll(server, home.parent, root, *labels)
    p.config.parent.rename(home)
    return p.device_id


def device(server: LiveServer, device_id: str) -> dict[str, Any]:
    with server.client() as c:
        return c.get(f"/v1/devices/{device_id}").json()


def wait_finished(server: LiveServer, job_id: str, agent_log: Path) -> dict[str, Any]:
    """The job once Succeeded or Failed (the agent's log and the server's tail if it never is)."""
    def finished() -> dict[str, Any] | None:
        with server.client() as c:
            j = c.get(f"/v1/jobs/{job_id}").json()
        return j if j["state"] in ("Succeeded", "Failed") else None

    return wait_for("the job to finish", finished, timeout=120,
                    on_fail=lambda: agent_log.read_text() + server.log()[-3000:])


def submit_on_upload(server: LiveServer, device_id: str, spec: dict[str, Any], npz: bytes,
                     agent_log: Path) -> str:
    """Once the phone is Ready: `npz` uploaded as the spec's dataset, the job submitted."""
    wait_for("Ready", lambda: device(server, device_id)["state"] == "Ready",
             on_fail=agent_log.read_text)
    with server.client() as c:
        up = c.post("/v1/datasets", data={"name": spec["dataset"]},
                    files={"file": ("data.npz", npz, "application/octet-stream")})
        assert up.status_code == 201, up.text
        job = c.post("/v1/jobs", json=spec)
        assert job.status_code == 201, job.text
        return job.json()["id"]


def test_enroll_heartbeat_kill_restart(server: LiveServer, tmp_path: Path, cool_phone: Path) -> None:
    home = tmp_path / "phone"
    device_id = enroll(server, home, cool_phone, "rack=a")
    config = home / "config.json"
    assert os.stat(config).st_mode & 0o777 == 0o600
    dev = device(server, device_id)
    assert dev["labels"]["rack"] == "a"
    assert dev["spec"]["cpu_cores"] == 8 and dev["spec"]["ram_mb"] == 7440
    assert [c["cores"] for c in dev["spec"]["clusters"]] == [[0, 1, 2, 3], [4, 5, 6], [7]]

    log = tmp_path / "agent.log"
    proc = agent_process(config, cool_phone, log)
    try:
        ready = wait_for("Ready with telemetry", lambda: (
            (d := device(server, device_id))["state"] == "Ready"
            and d["latest_telemetry"].get("battery_pct") == 87 and d), on_fail=log.read_text)
        assert ready["latest_telemetry"]["cpu_temp_c"] == 40.0
        assert ready["agent_version"] and "numpy" in ready["capabilities"]["backends"]
        # its compute class (a class job's shards stay on one) and its portable path
        facts = ready["capabilities"]["compute_class"]
        assert facts["fingerprint"] == fingerprint() and facts["machine"] == platform.machine()
        assert ready["compute_class"].endswith(f" #{fingerprint()[:8]}")
        assert "portable" in ready["capabilities"]["features"]
        proc.send_signal(signal.SIGKILL)  # Android's phantom process killer
        proc.wait(timeout=10)
        wait_for("NotReady after the kill",
                 lambda: device(server, device_id)["state"] == "NotReady", on_fail=server.log)
        proc = agent_process(config, cool_phone, log)
        wait_for("Ready after the restart",
                 lambda: device(server, device_id)["state"] == "Ready", on_fail=log.read_text)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert proc.returncode == 0, log.read_text()


def test_a_hot_phone_says_why_it_pauses(server: LiveServer, tmp_path: Path, cool_phone: Path) -> None:
    phone.set_value(cool_phone, "/sys/class/thermal/thermal_zone1/temp", 52000)
    home = tmp_path / "phone"
    device_id = enroll(server, home, cool_phone)
    log = tmp_path / "agent.log"
    proc = agent_process(home / "config.json", cool_phone, log)
    try:
        dev = wait_for("the thermal pause on the device", lambda: (
            (d := device(server, device_id))["pause_reason"] == "thermal" and d),
            on_fail=log.read_text)
        assert dev["latest_telemetry"]["cpu_temp_c"] == 52.0
        phone.set_value(cool_phone, "/sys/class/thermal/thermal_zone1/temp", 40000)
        wait_for("the pause lifted", lambda: device(server, device_id)["pause_reason"] is None,
                 on_fail=log.read_text)
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_a_deleted_device_stops_its_agent_with_a_clear_message(
    server: LiveServer, tmp_path: Path, cool_phone: Path
) -> None:
    home = tmp_path / "phone"
    device_id = enroll(server, home, cool_phone)
    log = tmp_path / "agent.log"
    proc = agent_process(home / "config.json", cool_phone, log)
    try:
        wait_for("Ready", lambda: device(server, device_id)["state"] == "Ready",
                 on_fail=log.read_text)
        with server.client() as c:
            assert c.delete(f"/v1/devices/{device_id}").status_code == 200
        code = proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert code == 3, text
    assert "enroll again" in text and "Traceback" not in text


def test_a_real_job_trains_on_the_agent(server: LiveServer, tmp_path: Path, cool_phone: Path) -> None:
    home = tmp_path / "phone"
    device_id = enroll(server, home, cool_phone)
    log = tmp_path / "agent.log"
    proc = agent_process(home / "config.json", cool_phone, log)
    # the user's own layer graph (placed only on agents that say they build one: "custom"),
    # on the user's own images: uint8 with per-channel mean and std, which the server keeps on
    # disk and the agent fetches as stored, in chunks, and normalizes itself
    own = [{"type": "flatten"}, {"type": "dense", "units": 10}]
    rng = np.random.default_rng(2)
    labels = np.arange(600) % 10
    images = np.clip(labels[:, None, None, None] * 20 + rng.integers(0, 60, (600, 3, 6, 6)),
                     0, 255).astype(np.uint8)
    buf = io.BytesIO()
    np.savez(buf, x=images, y=labels, mean=np.array([0.4, 0.45, 0.5]),
             std=np.array([0.25, 0.2, 0.3]))
    spec = {"name": "images-own", "model": {"layers": own}, "dataset": f"imgs-{device_id}",
            "global_batch_size": 96, "shards": 4, "epochs": 1, "seed": 0,
            "placement": {"min_devices": 1, "max_devices": 1}}  # 5 steps
    try:
        job_id = submit_on_upload(server, device_id, spec, buf.getvalue(), log)
        done = wait_finished(server, job_id, log)
        assert done["state"] == "Succeeded", done
        assert done["step"] == done["total_steps"] > 0
        ref = run_reference(spec, None, progress=False, data_dir=server.env["PHALANX_DATA_DIR"])
        assert done["metrics"]["train_loss"] == pytest.approx(ref["train_loss"], rel=1e-5)
        profile = wait_for("the measured profile on the device",
                           lambda: device(server, device_id)["profiles"].get("custom"))
        assert profile["samples_per_s"] > 0 and profile["backend"] == "numpy"
        # an operator reads the agent's recent lines from the control plane (phalanx devices
        # logs): asked in a heartbeat command, shipped by the agent from its ring
        from phalanx.client import PhalanxClient

        with PhalanxClient(server.url, server.admin_token) as client:
            shipped = client.device_logs(device_id, timeout_s=60)
        messages = [line["message"] for line in shipped["lines"]]
        assert any("execution choice for" in m for m in messages), messages
        assert any(m.startswith("agent.cli: agent ") for m in messages), messages
        assert [line["seq"] for line in shipped["lines"]] == sorted(
            line["seq"] for line in shipped["lines"])
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert "Traceback" not in log.read_text()


def test_a_job_that_diverges_fails_with_the_reason_instead_of_retrying(
        server: LiveServer, tmp_path: Path, cool_phone: Path) -> None:
    """Inputs of 30,000 make a micro-batch's gradient sum overflow float16 at the first step:
    the real agent's worker finds it not finite, the agent reports it, and the job fails
    saying so (before, the agent retried the step for ever and the job hung Running)."""
    home = tmp_path / "phone"
    device_id = enroll(server, home, cool_phone)
    log = tmp_path / "agent.log"
    proc = agent_process(home / "config.json", cool_phone, log)
    labels = np.arange(400) % 10
    buf = io.BytesIO()
    np.savez(buf, x=np.full((400, 1, 4, 4), 30000.0, np.float32), y=labels)
    spec = {"name": "diverges", "model": {"arch": "logreg"}, "dataset": f"huge-{device_id}",
            "global_batch_size": 96, "shards": 4, "epochs": 1, "seed": 0,
            "upload_precision": "float16", "placement": {"min_devices": 1, "max_devices": 1}}
    try:
        job_id = submit_on_upload(server, device_id, spec, buf.getvalue(), log)
        done = wait_finished(server, job_id, log)
        assert done["state"] == "Failed" and done["step"] == 0, done
        assert done["reason"].startswith("diverged at step 0: shard "), done["reason"]
        assert "not finite in float16" in done["reason"] and device_id in done["reason"]
        assert "reporting it" in log.read_text()
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_enrolling_with_a_bad_token_is_refused_clearly(server: LiveServer, tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "agent", "enroll", "--server", server.url,
                          "--token", "not-a-token", "--config", str(tmp_path / "c.json")],
                         cwd=REPO, capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.returncode == 2 and "enrollment refused" in out.stderr
    assert not (tmp_path / "c.json").exists()
    with httpx.Client(base_url=server.url) as c:  # the server is fine after it
        assert c.get("/healthz").status_code == 200


def test_a_revoked_device_token_stops_the_agent(
    server: LiveServer, tmp_path: Path, cool_phone: Path
) -> None:
    home = tmp_path / "phone"
    device_id = enroll(server, home, cool_phone)
    log = tmp_path / "agent.log"
    proc = agent_process(home / "config.json", cool_phone, log)
    try:
        wait_for("Ready", lambda: device(server, device_id)["state"] == "Ready",
                 on_fail=log.read_text)
        with server.client() as c:
            rows = c.get("/v1/tokens", params={"kind": "device", "limit": 500}).json()["items"]
            token_id = next(r["id"] for r in rows if r.get("device_id") == device_id)
            assert c.delete(f"/v1/tokens/{token_id}").status_code == 200
        code = proc.wait(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert code == 3, text
    assert "revoked" in text and "phalanx-agent enroll" in text


def test_an_unreachable_bulk_port_falls_back_to_the_api(tmp_path: Path, cool_phone: Path) -> None:
    """The assignment names an upload URL nothing listens on (a firewall, a missing port
    mapping): the agent says so once, uploads through the API port, and the job finishes."""
    import socket

    # a port held bound but not listening: connecting is refused, and no server started here
    # can be given it (a port merely found free once was, now and then, the server's own)
    dead = socket.socket()
    dead.bind(("127.0.0.1", 0))
    dead_url = f"http://127.0.0.1:{dead.getsockname()[1]}"
    root = tmp_path / "server"
    root.mkdir()
    srv = start_server(database_url=migrated_sqlite(root / "phalanx.sqlite"), data_dir=root / "data",
                       admin_token=ADMIN_TOKEN, extra_env={
                           **SERVER_ENV, "PHALANX_BULK_PUBLIC_URL": dead_url})
    home, log = tmp_path / "phone", tmp_path / "agent.log"
    try:
        device_id = enroll(srv, home, cool_phone)
        proc = agent_process(home / "config.json", cool_phone, log)
        try:
            wait_for("Ready", lambda: device(srv, device_id)["state"] == "Ready",
                     on_fail=log.read_text)
            spec = {"name": "fallback", "model": {"arch": "logreg"}, "dataset": "digits",
                    "global_batch_size": 256, "shards": 4, "epochs": 1, "seed": 0,
                    "placement": {"min_devices": 1, "max_devices": 1}}
            with srv.client() as c:
                job_id = c.post("/v1/jobs", json=spec).json()["id"]
            done = wait_finished(srv, job_id, log)
            assert done["state"] == "Succeeded" and done["step"] == done["total_steps"]
        finally:
            proc.terminate()
            proc.wait(timeout=30)
    finally:
        srv.stop()
        dead.close()
    text = log.read_text()
    assert text.count("unreachable") == 1 and "using the API port from now on" in text
    assert "Traceback" not in text


def test_a_device_token_is_rotated_by_a_heartbeat_command_without_enrolling_again(
        tmp_path: Path, cool_phone: Path) -> None:
    """Tokens older than PHALANX_DEVICE_TOKEN_MAX_AGE_S: the heartbeat says rotate_token, the
    agent gets a new one, saves it (0600) and uses it; the old one stops working after the
    grace period, and the phone stays Ready throughout."""
    rotating = start_server(database_url=migrated_sqlite(tmp_path / "r.sqlite"),
                            data_dir=tmp_path / "data", admin_token=ADMIN_TOKEN,
                            extra_env={**SERVER_ENV, "PHALANX_DEVICE_TOKEN_MAX_AGE_S": "2",
                                       "PHALANX_DEVICE_TOKEN_ROTATION_GRACE_S": "1"})
    try:
        home = tmp_path / "phone"
        device_id = enroll(rotating, home, cool_phone)
        config = home / "config.json"
        first = json.loads(config.read_text())["device_token"]
        log = tmp_path / "agent.log"
        proc = agent_process(config, cool_phone, log)
        try:
            rotated = wait_for("a rotated token in the config", lambda: (
                (t := json.loads(config.read_text())["device_token"]) != first and t),
                timeout=60, on_fail=log.read_text)
            assert os.stat(config).st_mode & 0o777 == 0o600
            with rotating.client(first) as old:
                wait_for("the old token to end", lambda: old.get(
                    f"/v1/devices/{device_id}/work").status_code == 401, timeout=30)
            renewed = device(rotating, device_id)["lease_renewed_at"]
            wait_for("heartbeats on the new token", lambda: (
                (d := device(rotating, device_id))["state"] == "Ready"
                and d["lease_renewed_at"] != renewed), timeout=30, on_fail=log.read_text)
            with rotating.client(rotated) as new:
                assert new.get(f"/v1/devices/{device_id}/work").status_code == 200
            assert "device token rotated" in log.read_text()
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0, log.read_text()
    finally:
        rotating.stop()
