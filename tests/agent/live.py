"""The real agent against the real control plane: a `phalanx server` (embedded: SQLite, the
in-process Celery worker and beat) shared by a test module, and phones enrolled on it with the
agent's own `enroll` command. Each phone gets a label of its own and each job selects it, so
tests sharing a server never train on each other's phones."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from tests.agent import phone
from tests.agent.helpers import REPO, agent_process
from tests.support.databases import migrated_sqlite
from tests.support.env import ADMIN_TOKEN, without_settings
from tests.support.server import LiveServer, start_server
from tests.support.waiting import wait_for

SERVER_ENV = {"PHALANX_LEASE_GRACE_S": "3", "PHALANX_HEARTBEAT_INTERVAL_S": "0.3",
              "PHALANX_RECONCILE_INTERVAL_S": "0.5"}
CPU_ZONES = ("/sys/class/thermal/thermal_zone0/temp", "/sys/class/thermal/thermal_zone1/temp")


def live_server(root: Path) -> Iterator[LiveServer]:
    """For a module-scoped fixture: one server for the module (starting one costs seconds)."""
    srv = start_server(database_url=migrated_sqlite(root / "phalanx.sqlite"),
                       data_dir=root / "data", admin_token=ADMIN_TOKEN, extra_env=SERVER_ENV)
    yield srv
    srv.stop()


def set_cpu_temp(root: Path, celsius: float) -> None:
    for zone in CPU_ZONES:
        phone.set_value(root, zone, int(celsius * 1000))


@dataclass
class Phone:
    """An enrolled phone: its sysfs tree, config, log and label."""

    server: LiveServer
    device_id: str
    root: Path
    config: Path
    log: Path
    label: str
    process: subprocess.Popen[bytes] | None = None

    def start(self) -> Phone:
        self.process = agent_process(self.config, self.root, self.log)
        return self

    def stop(self) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        return self.process.returncode

    def logs(self) -> str:
        return (self.log.read_text(errors="replace") if self.log.exists() else "") + \
            "\n--- server\n" + self.server.log()[-3000:]

    def device(self) -> dict[str, Any]:
        with self.server.client() as c:
            return c.get(f"/v1/devices/{self.device_id}").json()

    def events(self) -> list[dict[str, Any]]:
        with self.server.client() as c:
            return c.get(f"/v1/devices/{self.device_id}/events",
                         params={"limit": 500}).json()["items"]

    def telemetry(self) -> list[dict[str, Any]]:
        with self.server.client() as c:
            return c.get(f"/v1/devices/{self.device_id}/telemetry",
                         params={"limit": 1000}).json()["items"]

    def job_spec(self, **over: Any) -> dict[str, Any]:
        """digits logreg (25 steps an epoch at batch 64) placed on this phone only."""
        placement = {"min_devices": 1, "max_devices": 1, "max_temp_c": 45, "min_battery": 20,
                     "selector": {"phone": self.label}, **over.pop("placement", {})}
        return {"name": "digits-logreg", "model": {"arch": "logreg"}, "dataset": "digits",
                "global_batch_size": 64, "shards": 4, "epochs": 2, "seed": 0,
                "optimizer": {"lr": 0.1}, "placement": placement, **over}

    def wait(self, what: str, probe: Any, timeout: float = 90.0) -> Any:
        return wait_for(what, probe, timeout=timeout, on_fail=self.logs)


def enroll(server: LiveServer, tmp_path: Path, root: Path, *labels: str,
           **config: Any) -> Phone:
    """`python -m agent enroll` against the server, then the config's test knobs: short long
    polls (a stopped agent leaves no poll for the server to sit out), numpy only unless said."""
    with server.client() as c:
        token = c.post("/v1/enrollment-tokens", json={}).json()["token"]
    home = tmp_path / f"phone-{uuid.uuid4().hex[:6]}"
    path = home / "config.json"
    label = uuid.uuid4().hex[:10]
    env = without_settings()
    env.update(PYTHONPATH=str(REPO), PHALANX_SYSFS_ROOT=str(root))
    args = [sys.executable, "-m", "agent", "enroll", "--server", server.url, "--token", token,
            "--name", "s10-a", "--config", str(path), "--label", f"phone={label}"]
    for extra in labels:
        args += ["--label", extra]
    out = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    data = json.loads(path.read_text()) | {"work_wait_s": 2.0, "backends": ["numpy"], **config}
    path.write_text(json.dumps(data))
    return Phone(server, json.loads(out.stdout)["device_id"], root, path, home / "agent.log",
                 label)


@contextmanager
def running(p: Phone) -> Iterator[Phone]:
    """The phone's agent running for the block; at its end the agent must stop cleanly (0)."""
    p.start()
    try:
        yield p
    finally:
        code = p.stop()
    assert code == 0, p.logs()


def submit(server: LiveServer, spec: dict[str, Any]) -> str:
    with server.client() as c:
        r = c.post("/v1/jobs", json=spec)
    assert r.status_code == 201, r.text
    return r.json()["id"]


def job(server: LiveServer, job_id: str) -> dict[str, Any]:
    with server.client() as c:
        return c.get(f"/v1/jobs/{job_id}").json()


def cancel(server: LiveServer, job_id: str) -> None:
    with server.client() as c:
        c.post(f"/v1/jobs/{job_id}/cancel")


def shard_results(server: LiveServer) -> dict[str, float]:
    """`phalanx_shard_results_total` by outcome, from the server's /metrics."""
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    found = re.findall(r'^phalanx_shard_results_total\{outcome="(\w+)"\} (\S+)$', text, re.M)
    return {"accepted": 0.0, "duplicate": 0.0} | {k: float(v) for k, v in found}
