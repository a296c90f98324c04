"""The phone's network link: cutting it is what an agent sees when Wi-Fi drops."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from phalanx.sim.netproxy import NetLink


class Hello(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = b"x" * (4 << 20) if self.path == "/big" else b"hello"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def upstream() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Hello)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_requests_pass_while_up_fail_while_down_and_pass_again(upstream: str) -> None:
    link = NetLink(upstream)
    try:
        assert httpx.get(link.url, timeout=5).text == "hello"
        link.set_online(False)
        with pytest.raises(httpx.TransportError):
            httpx.get(link.url, timeout=5)
        link.set_online(True)
        assert httpx.get(link.url, timeout=5).text == "hello"
    finally:
        link.close()


def test_going_down_cuts_an_open_keep_alive_connection(upstream: str) -> None:
    link = NetLink(upstream)
    try:
        with httpx.Client(base_url=link.url, timeout=5) as client:
            assert client.get("/").status_code == 200
            link.set_online(False)
            with pytest.raises(httpx.TransportError):
                client.get("/")
    finally:
        link.close()


def test_a_large_response_arrives_whole_when_the_server_closes_after_it(upstream: str) -> None:
    link = NetLink(upstream)
    try:
        for _ in range(5):
            assert len(httpx.get(f"{link.url}/big", timeout=10).content) == 4 << 20
    finally:
        link.close()
