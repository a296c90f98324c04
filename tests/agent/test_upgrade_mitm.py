"""A rollout over plain http with someone on the path (issue 42, item 9), end to end: a real
server rolls out its build; between it and the phone a proxy swaps the archive for a tampered
copy (the attacker's code in front of `python -m agent`) and rewrites the heartbeat's
`upgrade` command to the tampered copy's hash, passing everything else through. The phone's
real agent, started by launch.sh, never runs the attacker's code: it refuses the build (not
signed by the key it trusts) and its report reaches the operator."""

from __future__ import annotations

import hashlib
import http.client
import json
import re
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from agent.slots import Slots
from tests.agent import live
from tests.agent.test_signed_upgrades import tampered
from tests.agent.test_upgrade_live import reasons, rollout, serving, supervised
from tests.support.server import stop_process

HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
       "upgrade", "content-length", "host"}
HEARTBEAT = re.compile(r"^/v1/devices/[^/]+/heartbeat$")


class Attacker:
    """What the attacker does to the answers it relays."""

    def __init__(self, payload: str) -> None:
        self.payload = payload
        self.swapped: bytes | None = None
        self.archives = self.commands = 0

    def prepare(self, genuine: bytes) -> None:
        self.swapped = tampered(genuine, self.payload)

    def rewrite(self, path: str, status: int, body: bytes) -> bytes:
        if status != 200:
            return body
        if path == "/agent.tar.gz":
            self.prepare(body)
            self.archives += 1
            return self.swapped
        if HEARTBEAT.match(path.split("?")[0]) and self.swapped is not None:
            reply = json.loads(body)
            for cmd in reply.get("commands") or []:
                if cmd.get("type") == "upgrade":
                    cmd["sha256"] = hashlib.sha256(self.swapped).hexdigest()
                    self.commands += 1
            return json.dumps(reply).encode()
        return body


@contextmanager
def man_in_the_middle(upstream: str, attacker: Attacker) -> Iterator[str]:
    """A plain-http proxy in front of `upstream` (http://host:port); yields its URL."""
    host, port = upstream.removeprefix("http://").rsplit(":", 1)

    class Relay(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _relay(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            body = self.rfile.read(length) if length else None
            headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP}
            conn = http.client.HTTPConnection(host, int(port), timeout=120)
            try:
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                data, status, answer = resp.read(), resp.status, resp.getheaders()
            finally:
                conn.close()
            if attacker.swapped is None and HEARTBEAT.match(self.path.split("?")[0]):
                # the genuine archive, fetched once: the tampered copy's hash goes into
                # the commands before the phone asks for the archive
                fetch = http.client.HTTPConnection(host, int(port), timeout=120)
                try:
                    fetch.request("GET", "/agent.tar.gz")
                    attacker.prepare(fetch.getresponse().read())
                finally:
                    fetch.close()
            data = attacker.rewrite(self.path, status, data)
            self.send_response(status)
            for key, value in answer:
                if key.lower() not in HOP:
                    self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = do_PUT = do_DELETE = _relay

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Relay)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_a_tampered_rollout_over_plain_http_never_runs(tmp_path: Path, cool_phone: Path) -> None:
    owned = tmp_path / "owned"
    attacker = Attacker(f"open({str(owned)!r}, 'w').write('owned')\n")
    server = serving(tmp_path, "0.2.0")
    home = tmp_path / "agent-home"
    with man_in_the_middle(server.url, attacker) as proxy:
        p = live.enroll(server, tmp_path, cool_phone)
        config = json.loads(p.config.read_text())
        p.config.write_text(json.dumps({**config, "server": proxy}))  # the phone talks via it
        loop = supervised(p, home)  # the server's release key pinned (the checkout has none)
        try:
            p.wait("the old agent heartbeats", lambda: p.device()["agent_version"] == "0.1.0")
            assert rollout(server, version="0.2.0", max_parallel=1).status_code == 200
            p.wait("the phone refuses the build, or runs it",
                   lambda: owned.exists() or reasons(p, "AgentUpgradeFailed"), timeout=120)
            assert not owned.exists(), "the attacker's code ran on the phone"
            assert attacker.commands >= 1 and attacker.archives >= 1  # it did try
            failed, = reasons(p, "AgentUpgradeFailed")
            assert "not signed by a release key this agent trusts" in failed["message"], failed
            assert Slots(home).current == ""
            assert p.device()["agent_version"] == "0.1.0" and p.device()["state"] == "Ready"
            assert p.device()["upgrade_failed"] == "0.2.0"
        finally:
            stop_process(loop, group=True)
            server.stop()
    assert not owned.exists()
