"""A real `phalanx server` subprocess on a free port, for tests that need a live control plane."""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import ssl
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.support.env import without_settings

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    """A port nothing listens on, from below the kernel's ephemeral range: the local port of an
    outgoing connection (the suite makes thousands) is drawn from that range and could take a
    port picked there before the server binds it."""
    below = ephemeral_ports()[0]
    for _ in range(200 if below - PORTS_FROM >= 1000 else 0):
        port = random.randrange(PORTS_FROM, below)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # none found there: any free one
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


PORTS_FROM = 20_000


def ephemeral_ports() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32_768, 60_999  # Linux's default


@dataclass
class LiveServer:
    url: str
    admin_token: str
    process: subprocess.Popen
    log_path: Path
    env: dict[str, str] = field(default_factory=dict)
    ca_file: Path | None = None  # https: the CA the server's certificate is checked against

    def client(self, token: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token or self.admin_token}"}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30,
                            verify=trusting(self.ca_file))

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, kill: bool = False) -> None:
        """Stop the server and every process it started (uvicorn's workers with --workers N:
        a SIGKILLed parent would leave them serving)."""
        stop_process(self.process, kill=kill, group=True)


def stop_process(process: subprocess.Popen, kill: bool = False, timeout_s: float = 15,
                 group: bool = False) -> None:
    """Terminate (or kill) a child and reap it; one that ignores SIGTERM is killed. `group`:
    the child leads its own session (start_new_session), and the signal goes to all of it."""
    def send(sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            if group:
                os.killpg(process.pid, sig)
            else:
                process.send_signal(sig)

    if process.poll() is None:
        send(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            send(signal.SIGKILL)
            process.wait(timeout=5)
    if group:  # the leader is gone; what it left behind goes too
        send(signal.SIGKILL)


def start_server(
    *,
    database_url: str,
    data_dir: Path,
    admin_token: str,
    redis_url: str | None = None,
    extra_env: dict[str, str] | None = None,
    port: int | None = None,
    args: list[str] | None = None,
    timeout_s: float = 60.0,
    python: str = sys.executable,
    cwd: Path = REPO_ROOT,
    tls: tuple[Path, Path] | None = None,
) -> LiveServer:
    """`python -m phalanx.cli.main server` run in `cwd`: the repository's code by default, or
    an installed phalanx when `python` is another environment's and `cwd` lies outside the
    repository. `tls`: (certificate, key), self-signed: https, checked against the certificate.

    Ports it picks itself are picked again when the server finds one taken: a port free when
    asked can be taken before the server binds it (another test's server picked it too)."""
    chosen = dict(database_url=database_url, data_dir=data_dir, admin_token=admin_token,
                  redis_url=redis_url, extra_env=extra_env, args=args, timeout_s=timeout_s,
                  python=python, cwd=cwd, tls=tls)
    for _ in range(PORT_TRIES - 1):
        try:
            return _start_server(port=port, **chosen)
        except PortTaken:
            if port is not None:
                raise
    return _start_server(port=port, **chosen)  # the last try: its failure is the caller's


PORT_TRIES = 4


class PortTaken(RuntimeError):
    """The server exited because a port it was given was taken before it could bind it."""


def _start_server(*, database_url: str, data_dir: Path, admin_token: str, redis_url: str | None,
                  extra_env: dict[str, str] | None, port: int | None, args: list[str] | None,
                  timeout_s: float, python: str, cwd: Path,
                  tls: tuple[Path, Path] | None) -> LiveServer:
    port = port or free_port()
    data_dir.mkdir(parents=True, exist_ok=True)
    env = without_settings()
    env.update(
        PHALANX_DATABASE_URL=database_url,
        PHALANX_DATA_DIR=str(data_dir),
        PHALANX_ADMIN_TOKEN=admin_token,
        PYTHONUNBUFFERED="1",
    )
    if redis_url:
        env["PHALANX_REDIS_URL"] = redis_url
    env.update(extra_env or {})
    log_path = data_dir / f"server-{port}.log"
    args = list(args or [])
    if "--bulk-port" not in args and "PHALANX_BULK_PORT" not in env:
        # a free one, not the default API port + 1: with tests in parallel another process
        # may hold that one, and the server then serves the steps on the API port only
        bulk = free_port()
        while bulk == port:  # the bulk listener binds first and would take the API's port
            bulk = free_port()
        args += ["--bulk-port", str(bulk)]
    cmd = [python, "-m", "phalanx.cli.main", "server", "--host", "127.0.0.1",
           "--port", str(port), *args]
    if tls is not None:
        cmd += ["--tls-cert", str(tls[0]), "--tls-key", str(tls[1])]
    logged_before = log_path.stat().st_size if log_path.exists() else 0
    with log_path.open("ab") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
    server = LiveServer(f"{'https' if tls else 'http'}://127.0.0.1:{port}", admin_token, proc,
                        log_path, env, ca_file=tls[0] if tls else None)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            # "address already in use" (one process) or "Address already in use" (--workers N);
            # a taken bulk or peer port is only a warning: the server goes on without it
            this_start = log_path.read_bytes()[logged_before:].lower()
            taken = PortTaken if b"address already in use" in this_start else RuntimeError
            raise taken(f"phalanx server exited with {proc.returncode}:\n{server.log()}")
        try:
            if httpx.get(f"{server.url}/healthz", timeout=1,
                         verify=trusting(server.ca_file)).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    server.stop(kill=True)
    raise RuntimeError(f"phalanx server did not answer /healthz within {timeout_s}s:\n{server.log()}")


def trusting(ca_file: Path | None) -> ssl.SSLContext | bool:
    return ssl.create_default_context(cafile=str(ca_file)) if ca_file else True


def self_signed_pair(directory: Path, host: str = "127.0.0.1") -> tuple[Path, Path]:
    """A certificate for `host` (an IP address) and its key, made by openssl: what a lab makes
    for a server without a public name."""
    cert, key = directory / "server.pem", directory / "server.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "2", "-subj", f"/CN={host}", "-addext",
                    f"subjectAltName=IP:{host}"], check=True, capture_output=True, timeout=60)
    return cert, key
