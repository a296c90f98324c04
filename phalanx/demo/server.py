"""The embedded control plane as a child process: `phalanx server` with no database or Redis
URL, i.e. SQLite in the data dir, Celery on its in-memory transport inside the server process,
the in-process blob store (DESIGN.md, "Two modes, one code path")."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

# A demo cannot wait 40 s to notice a dead phone; these are ordinary settings (domain/settings.py).
DEMO_SETTINGS = {
    "PHALANX_HEARTBEAT_INTERVAL_S": "2",
    "PHALANX_LEASE_GRACE_S": "8",
    "PHALANX_RECONCILE_INTERVAL_S": "1",
}


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


@dataclass
class EmbeddedServer:
    url: str
    admin_token: str
    data_dir: Path
    process: subprocess.Popen[bytes]
    log_path: Path

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    @property
    def alive(self) -> bool:
        return self.process.poll() is None

    def terminate(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)

    def stop(self, timeout_s: float = 20.0) -> None:
        if self.process.poll() is None:
            self.terminate()
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)


def start_embedded_server(data_dir: Path, *, host: str = "127.0.0.1", port: int | None = None,
                          admin_token: str | None = None, settings: dict[str, str] | None = None,
                          timeout_s: float = 90.0) -> EmbeddedServer:
    """Start `phalanx server` and wait until `/healthz` answers."""
    data_dir.mkdir(parents=True, exist_ok=True)
    port = port or free_port(host)
    token = admin_token or f"phx-admin-{secrets.token_urlsafe(24)}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PHALANX_")}
    env.update(DEMO_SETTINGS)
    env.update(settings or {})
    env.update(PHALANX_DATA_DIR=str(data_dir), PHALANX_ADMIN_TOKEN=token, PYTHONUNBUFFERED="1")
    log_path = data_dir / "server.log"
    # no bulk port: each simulated phone reaches the server only through its own cuttable link
    # (phalanx.sim.netproxy), and a bulk URL would let it go around the "loses network" fault
    cmd = [sys.executable, "-m", "phalanx.cli.main", "server", "--host", host, "--port", str(port),
           "--bulk-port", "0"]
    with log_path.open("ab") as log:
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    server = EmbeddedServer(f"http://{host}:{port}", token, data_dir, proc, log_path)
    try:
        _wait_healthy(server, timeout_s)
    except BaseException:  # a timeout, or Ctrl-C/SIGTERM meanwhile: nothing left running
        server.stop()
        raise
    return server


def _wait_healthy(server: EmbeddedServer, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not server.alive:
            raise RuntimeError(f"phalanx server exited with {server.process.returncode}:\n"
                               f"{server.log_tail()}")
        try:
            if httpx.get(f"{server.url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"phalanx server did not answer within {timeout_s:.0f}s:\n{server.log_tail()}")
