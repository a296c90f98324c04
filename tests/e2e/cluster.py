"""A real cluster on one machine for end-to-end tests: `phalanx server`, optional `phalanx
worker` processes on Redis, and phones running the real agent (`python -m agent enroll|run`).

Nothing here fakes a part: every process is the product's own entry point. Waits poll with
generous deadlines and say what they waited for when they give up.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.support.server import REPO_ROOT, LiveServer, start_server
from tests.support.waiting import DEADLINE_S, wait_for


def _clean_env(source_tree: bool = True) -> dict[str, str]:
    """The environment without PHALANX_ settings; `source_tree`: the repository's code on the
    path (an installed phalanx is used when it is False)."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PHALANX_") and k != "PYTHONPATH"}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1",
               MKL_NUM_THREADS="1")
    if source_tree:
        env["PYTHONPATH"] = str(REPO_ROOT)
    return env


@dataclass(frozen=True)
class Install:
    """Which phalanx runs: the repository's code (the default), or a plain `pip install .`
    in another environment, run from outside the repository so its source is not imported."""

    python: str = sys.executable
    cwd: Path = REPO_ROOT

    @property
    def source_tree(self) -> bool:
        return self.cwd == REPO_ROOT

    def env(self) -> dict[str, str]:
        return _clean_env(self.source_tree)


@dataclass
class Agent:
    name: str
    home: Path
    process: subprocess.Popen[bytes] | None = None
    device_id: str | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def config(self) -> Path:
        return self.home / "config.json"

    @property
    def log_path(self) -> Path:
        return self.home / "agent.log"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()


@dataclass
class Worker:
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self) -> None:
        """SIGKILL the worker and anything it started, as when its machine dies."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=10)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=3)  # warm shutdown; nothing here needs more
            except subprocess.TimeoutExpired:
                pass
        self.kill()


class Cluster:
    def __init__(self, root: Path, database_url: str, admin_token: str,
                 redis_url: str | None = None, server_env: dict[str, str] | None = None,
                 install: Install | None = None, tls: tuple[Path, Path] | None = None) -> None:
        self.root, self.database_url, self.redis_url = root, database_url, redis_url
        self.tls = tls  # (certificate, key): every replica serves https, agents check it
        self.admin_token = admin_token
        self.install = install or Install()
        self.data_dir = root / "data"
        self.server_env = {"PHALANX_RECONCILE_INTERVAL_S": "0.5", "PHALANX_LEASE_GRACE_S": "10",
                           "PHALANX_HEARTBEAT_INTERVAL_S": "1",
                           "PHALANX_SCHED_APPLY_CLAIM_TTL_S": "3", **(server_env or {})}
        self.server: LiveServer | None = None  # the first replica
        self.replicas: list[LiveServer] = []
        self.agents: list[Agent] = []
        self.workers: list[Worker] = []

    # -- processes ---------------------------------------------------------------------------
    def start_server(self, port: int | None = None, args: list[str] | None = None) -> LiveServer:
        """Start an API replica (the first one becomes `self.server`)."""
        replica = start_server(database_url=self.database_url, data_dir=self.data_dir,
                               admin_token=self.admin_token, redis_url=self.redis_url,
                               extra_env=self.server_env, port=port, args=args,
                               python=self.install.python, cwd=self.install.cwd, tls=self.tls)
        self.replicas.append(replica)
        self.server = self.server or replica
        return replica

    def restart_server(self) -> LiveServer:
        """SIGKILL the API process and start a new one on the same port (agents keep the URL)."""
        assert self.server is not None
        port = int(self.server.url.rsplit(":", 1)[1])
        self.server.stop(kill=True)
        self.replicas.remove(self.server)
        self.server = None
        return self.start_server(port)

    def start_worker(self, extra_env: dict[str, str] | None = None, beat: bool = True,
                     argv: list[str] | None = None, ready_line: str = "ready") -> Worker:
        """`phalanx worker` (or `argv`: a command of the installed phalanx, such as the
        deployment's beat) with the cluster's settings; returns once it logged "ready"."""
        assert self.redis_url, "a separate worker needs Redis"
        env = self.install.env()
        env.update({"PHALANX_DATABASE_URL": self.database_url, "PHALANX_REDIS_URL": self.redis_url,
                    "PHALANX_DATA_DIR": str(self.data_dir), "PHALANX_ADMIN_TOKEN": self.admin_token,
                    **self.server_env, **(extra_env or {})})  # the worker's own settings win
        log_path = self.root / f"worker-{len(self.workers)}.log"
        cmd = [self.install.python, "-m", "phalanx.cli.main", "worker", "--concurrency", "2",
               *(["--beat"] if beat else [])]
        if argv is not None:
            cmd = [self.install.python, "-m", *argv]
        with log_path.open("ab") as fh:
            proc = subprocess.Popen(cmd, cwd=self.install.cwd, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        worker = Worker(proc, log_path)
        self.workers.append(worker)
        wait_for("the worker to connect", lambda: proc.poll() is not None or ready_line in worker.log(),
                 timeout=60, on_fail=worker.log)
        assert proc.poll() is None, worker.log()
        return worker

    def start_agent(self, name: str, extra_env: dict[str, str] | None = None,
                    server: LiveServer | None = None,
                    runner: tuple[str, ...] = ("agent",)) -> Agent:
        """Enroll a phone on `server` (default: the first replica) and run its agent
        (`runner`: the module and its arguments that run it, e.g. a lying phone's
        `("phalanx.sim.liar", "--lie", "flip")`)."""
        server = server or self.server
        assert server is not None
        home = self.root / "agents" / name
        (home / "sysfs").mkdir(parents=True, exist_ok=True)
        agent = Agent(name, home)
        agent.env = {**self.install.env(), "PHALANX_SYSFS_ROOT": str(home / "sysfs"),
                     "HOME": str(home), **(extra_env or {})}
        token = self.enrollment_token()
        subprocess.run([self.install.python, "-m", "agent", "enroll", "--server", server.url,
                        "--token", token, "--name", name, "--config", str(agent.config),
                        *(["--ca-file", str(self.tls[0])] if self.tls else [])],
                       cwd=self.install.cwd, env=agent.env, check=True, capture_output=True, timeout=60)
        agent.device_id = json.loads(agent.config.read_text())["device_id"]
        core = {sorted(os.sched_getaffinity(0))[len(self.agents) % len(os.sched_getaffinity(0))]}
        with agent.log_path.open("ab") as fh:
            # one core per phone: fewer execution candidates to profile, less contention
            agent.process = subprocess.Popen(
                [self.install.python, "-m", *runner, "run", "--config", str(agent.config)],
                cwd=self.install.cwd, env=agent.env, stdout=fh, stderr=subprocess.STDOUT,
                preexec_fn=lambda: os.sched_setaffinity(0, core))
        self.agents.append(agent)
        return agent

    def stop(self) -> None:
        # all at once: one by one, each agent's graceful exit would add up
        live = [a.process for a in self.agents if a.process and a.process.poll() is None]
        for proc in live:
            proc.terminate()
        deadline = time.monotonic() + 3
        for proc in live:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        for worker in self.workers:
            worker.stop()
        for replica in self.replicas:
            replica.stop(kill=True)  # its graceful shutdown is not under test here

    # -- API ---------------------------------------------------------------------------------
    def client(self) -> httpx.Client:
        assert self.server is not None
        return self.server.client()

    def enrollment_token(self) -> str:
        with self.client() as c:
            r = c.post("/v1/enrollment-tokens", json={"max_uses": 1})
            r.raise_for_status()
            return r.json()["token"]

    def submit(self, spec: dict[str, Any]) -> str:
        with self.client() as c:
            r = c.post("/v1/jobs", json=spec)
            assert r.status_code == 201, r.text
            return r.json()["id"]

    def job(self, job_id: str) -> dict[str, Any]:
        with self.client() as c:
            r = c.get(f"/v1/jobs/{job_id}")
            r.raise_for_status()
            return r.json()

    def device(self, device_id: str) -> dict[str, Any]:
        with self.client() as c:
            r = c.get(f"/v1/devices/{device_id}")
            r.raise_for_status()
            return r.json()

    def events(self, job_id: str) -> list[dict[str, Any]]:
        with self.client() as c:
            r = c.get(f"/v1/jobs/{job_id}/events", params={"limit": 1000})
            r.raise_for_status()
            body = r.json()
            return body["items"] if isinstance(body, dict) and "items" in body else body

    def diagnostics(self) -> str:
        parts = [f"--- server {r.url}\n{r.log()[-4000:]}" for r in self.replicas]
        parts += [f"--- worker {i}\n{w.log()[-3000:]}" for i, w in enumerate(self.workers)]
        parts += [f"--- agent {a.name}\n{a.log()[-2000:]}" for a in self.agents]
        return "\n".join(parts)

    def wait_job(self, job_id: str, predicate: Callable[[dict[str, Any]], bool], what: str,
                 timeout: float = DEADLINE_S) -> dict[str, Any]:
        def probe() -> dict[str, Any] | None:
            job = self.job(job_id)
            return job if predicate(job) else None

        return wait_for(what, probe, timeout=timeout, every=0.2,
                        on_fail=lambda: f"job={self.job(job_id)}\n{self.diagnostics()}")

    def wait_done(self, job_id: str, timeout: float = DEADLINE_S) -> dict[str, Any]:
        job = self.wait_job(job_id, lambda j: j["state"] in ("Succeeded", "Failed", "Cancelled"),
                            "the job to finish", timeout)
        assert job["state"] == "Succeeded", f"{job}\n{self.diagnostics()}"
        return job


def reference_metrics(spec: dict[str, Any], out: Path) -> dict[str, Any]:
    """`phalanx train --local SPEC`: its last output line is the final metrics as JSON."""
    out.mkdir(parents=True, exist_ok=True)
    spec_path = out / "spec.json"
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.run(
        [sys.executable, "-m", "phalanx.cli.main", "train", "--local", str(spec_path),
         "--out", str(out / "ref")],
        cwd=REPO_ROOT, env=_clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def rel_diff(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)
