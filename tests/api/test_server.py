"""`phalanx server` as a real process: migrations at start, the admin token, real concurrency."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import psutil
import pytest

from tests.support import server as server_support
from tests.support.env import ADMIN_TOKEN as ADMIN
from tests.support.env import without_settings
from tests.support.server import REPO_ROOT, free_port, start_server


def _run_server_once(data_dir) -> str:
    """Start `phalanx server` without PHALANX_ADMIN_TOKEN, wait for /healthz, stop; its output."""
    env = without_settings()
    env.update(PHALANX_DATA_DIR=str(data_dir), PYTHONUNBUFFERED="1")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "phalanx.cli.main", "server", "--port",
                             str(port)], cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        for _ in range(600):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                if proc.poll() is not None:
                    break
                time.sleep(0.1)
        proc.terminate()
        out, _ = proc.communicate(timeout=20)
    finally:
        proc.kill()
    return out


def test_a_generated_admin_token_goes_to_a_private_file_not_the_log(tmp_path):
    import stat

    first = _run_server_once(tmp_path)
    token_file = tmp_path / "admin-token"
    lines = [line for line in first.splitlines() if "generated an admin token" in line]
    assert len(lines) == 1 and str(token_file) in lines[0], first
    secret = token_file.read_text().strip()
    assert secret.startswith("phx-adm-") and secret not in first  # not in the output (logs)
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    token_file.unlink()  # read and kept, as the line says
    second = _run_server_once(tmp_path)
    assert "admin token" not in second and not token_file.exists()
    assert secret not in (tmp_path / "phalanx.sqlite").read_bytes().decode("latin-1")


def test_db_upgrade_command(tmp_path):
    env = without_settings()
    env["PHALANX_DATA_DIR"] = str(tmp_path)
    out = subprocess.run([sys.executable, "-m", "phalanx.cli.main", "db", "upgrade"],
                         cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "newest schema" in out.stdout
    assert (tmp_path / "phalanx.sqlite").is_file()


# these send each phone's heartbeats back to back: past the per-device rate, not under test here
FLOOD = {"PHALANX_HEARTBEAT_BURST": "1000"}


def test_live_server_concurrent_heartbeats_lose_no_sample(sqlite_url, tmp_path):
    live_server = start_server(database_url=sqlite_url, data_dir=tmp_path / "d",
                               admin_token=ADMIN, extra_env=FLOOD)
    admin = live_server.client()
    enroll = admin.post("/v1/enrollment-tokens", json={}).json()["token"]
    devices = [admin.post("/v1/devices/register", json={"enrollment_token": enroll,
                                                        "name": f"p{i}"}).json()
               for i in range(6)]
    rounds = 20

    def beat(args):
        device, i = args
        with live_server.client(device["device_token"]) as client:
            body = {"telemetry": [{"ts": 1000.0 + i * 3 + k, "battery_pct": 50} for k in range(3)]}
            return client.post(f"/v1/devices/{device['device_id']}/heartbeat", json=body).status_code

    with ThreadPoolExecutor(max_workers=24) as pool:
        codes = list(pool.map(beat, [(d, i) for d in devices for i in range(rounds)]))
    assert codes == [200] * (len(devices) * rounds)
    for device in devices:
        history = admin.get(f"/v1/devices/{device['device_id']}/telemetry").json()["items"]
        assert len(history) == rounds * 3
    admin.close()
    live_server.stop()


def test_postgres_server_with_two_workers(pg_url, tmp_path, redis_url):
    bulk_port = free_port()  # not API port + 1: another process may hold that one
    server = start_server(database_url=pg_url, data_dir=tmp_path / "d", admin_token=ADMIN,
                          redis_url=redis_url, args=["--workers", "2", "--bulk-port", str(bulk_port)],
                          extra_env=FLOOD)
    try:
        with server.client() as admin:
            assert admin.get("/readyz").status_code == 200
            enroll = admin.post("/v1/enrollment-tokens", json={}).json()["token"]
            device = admin.post("/v1/devices/register",
                                json={"enrollment_token": enroll, "name": "p"}).json()
        with server.client(device["device_token"]) as client:
            for i in range(20):
                resp = client.post(f"/v1/devices/{device['device_id']}/heartbeat",
                                   json={"telemetry": [{"ts": float(i)}]})
                assert resp.status_code == 200
        with server.client() as admin:
            history = admin.get(f"/v1/devices/{device['device_id']}/telemetry").json()["items"]
            assert len(history) == 20
        # both workers listen on the bulk port (shared with SO_REUSEPORT): every fresh
        # connection, whichever worker takes it, gets the API's answer
        bulk = server.url.rsplit(":", 1)[0] + f":{bulk_port}"
        for _ in range(10):
            r = httpx.get(f"{bulk}/v1/jobs/nope/weights", params={"step": 0}, timeout=10,
                          headers={"Authorization": f"Bearer {device['device_token']}"})
            assert r.status_code == 404 and r.json() == {"detail": "job nope not found"}
        assert "not available" not in server.log()
    finally:
        server.stop()


def test_bulk_port_flag_moves_or_turns_off_the_bulk_listener(sqlite_url, tmp_path):
    bulk = free_port()
    server = start_server(database_url=sqlite_url, data_dir=tmp_path / "a", admin_token=ADMIN,
                          args=["--bulk-port", str(bulk)])
    try:
        r = httpx.get(f"http://127.0.0.1:{bulk}/v1/jobs/j/weights", params={"step": 0}, timeout=10)
        assert r.status_code == 401 and "bearer token" in r.json()["detail"]
    finally:
        server.stop()
    port = free_port()
    server = start_server(database_url=sqlite_url, data_dir=tmp_path / "b", admin_token=ADMIN,
                          port=port, args=["--bulk-port", "0"])
    try:
        assert httpx.get(f"{server.url}/healthz", timeout=10).status_code == 200
        # the server's own listening sockets, not a guess at port + 1 (which another process
        # may hold): the API port alone
        listening = {c.laddr.port for c in psutil.Process(server.process.pid).net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN}
        assert listening == {port}
    finally:
        server.stop()


def test_a_gradient_upload_without_a_valid_token_is_refused_before_its_body(
        sqlite_url, tmp_path) -> None:
    """A stranger announces a 60 MB upload and sends 1 MB of it: the answer (401) comes from
    its headers, while the rest is still unsent; nothing waits to hold 60 MB for it."""
    server = start_server(database_url=sqlite_url, data_dir=tmp_path / "d", admin_token=ADMIN)
    port = int(server.url.rsplit(":", 1)[1])
    try:
        # unknown: 401 from the headers (docs/api.md, "The token comes before the body");
        # valid but not a device's: 403, the route's word on the kind of token it needs
        for token, status in (("nope", b"401 Unauthorized"), (ADMIN, b"403 Forbidden")):
            with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
                sock.sendall(b"POST /v1/jobs/j/steps/0/gradients HTTP/1.1\r\nHost: x\r\n"
                             b"Content-Length: 60000000\r\nAuthorization: Bearer "
                             + token.encode() + b"\r\n\r\n" + b"\0" * 1_000_000)
                head = sock.recv(100)
            assert head.split(b"\r\n")[0] == b"HTTP/1.1 " + status, (token, head)
        assert httpx.get(f"{server.url}/healthz", timeout=10).status_code == 200
    finally:
        server.stop()


def test_a_guessable_admin_token_is_refused_at_start_in_one_line(sqlite_url, tmp_path) -> None:
    env = {**without_settings(), "PYTHONPATH": str(REPO_ROOT),
           "PHALANX_DATABASE_URL": sqlite_url, "PHALANX_DATA_DIR": str(tmp_path / "d")}
    for placeholder in ("CHANGE-ME", "admin", "x" * 31):
        for command in (["server", "--port", str(free_port())], ["db", "upgrade"]):
            proc = subprocess.run([sys.executable, "-m", "phalanx.cli.main", *command],
                                  env={**env, "PHALANX_ADMIN_TOKEN": placeholder},
                                  capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
            assert proc.returncode == 2, proc.stderr
            assert proc.stderr.strip() == ("phalanx: PHALANX_ADMIN_TOKEN: must be at least 32 "
                                           "characters: make one with `openssl rand -hex 32`")


@pytest.mark.parametrize("workers", [1, 2])
def test_a_test_server_whose_port_is_taken_before_it_binds_starts_on_another(
        pg_url, redis_url, tmp_path, monkeypatch, workers: int) -> None:
    """The suite's own helper: a port free when picked can be taken before the server binds it
    (tests run in parallel, and outgoing connections draw local ports from the same range). One
    process and uvicorn's --workers (Redis mode) say so in different words."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        taken_port = taken.getsockname()[1]
        picks = iter([taken_port])
        monkeypatch.setattr(server_support, "free_port",
                            lambda: next(picks, None) or free_port())
        server = start_server(database_url=pg_url, redis_url=redis_url, data_dir=tmp_path / "d",
                              admin_token=ADMIN, args=["--workers", str(workers)])
        try:
            assert not server.url.endswith(f":{taken_port}")
            assert httpx.get(f"{server.url}/healthz", timeout=10).status_code == 200
            assert "address already in use" in (tmp_path / "d" / f"server-{taken_port}.log"
                                                ).read_text().lower()
        finally:
            server.stop()
