"""The HTTP client: one exception tree over real sockets, and backoff that spreads a fleet."""

from __future__ import annotations

import json
import random
import socket
import statistics
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from agent.client import (
    Backoff,
    Client,
    Conflict,
    RequestTimeout,
    ServerError,
    StatusError,
    TransportError,
    Unauthorized,
)


@pytest.fixture
def answering() -> Iterator[str]:
    """A server answering `/status/<code>` with that code and a JSON detail."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802
            code = int(self.path.rsplit("/", 1)[-1])
            body = json.dumps({"detail": f"you got {code}"}).encode()
            if code == 299:
                code, body = 200, b"<html>not json</html>"
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.mark.parametrize(("code", "error"), [(401, Unauthorized), (409, Conflict),
                                             (503, ServerError), (500, ServerError),
                                             (404, StatusError), (422, StatusError)])
def test_status_codes_map_to_the_exception_tree(answering: str, code: int, error: type) -> None:
    with pytest.raises(error) as info:
        Client(answering)._send("GET", f"/status/{code}")
    assert info.value.status == code
    assert info.value.detail == f"you got {code}"


def test_invalid_json_from_the_server_is_a_transport_error(answering: str) -> None:
    with pytest.raises(TransportError):
        Client(answering)._send("GET", "/status/299").json()


def test_a_refused_connection_is_a_transport_error() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again: nobody listens here
    with pytest.raises(TransportError) as info:
        Client(f"http://127.0.0.1:{port}").heartbeat("dev-1", {"telemetry": []})
    assert not isinstance(info.value, StatusError)


def test_a_server_that_never_answers_times_out() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)  # accepts the connection, never says a word
        port = sock.getsockname()[1]
        with pytest.raises(RequestTimeout):
            Client(f"http://127.0.0.1:{port}", timeout_s=0.3)._send("GET", "/healthz")


def test_only_http_urls_are_accepted() -> None:
    with pytest.raises(ValueError, match="http"):
        Client("file:///etc/passwd")


def test_backoff_grows_exponentially_up_to_the_cap() -> None:
    rng = random.Random(1)
    b = Backoff(base_s=0.5, cap_s=60.0, rng=rng)
    delays = [b.delay() for _ in range(200)]
    assert all(0 <= d <= 60.0 for d in delays)
    assert all(d <= 0.5 * 2**i for i, d in enumerate(delays[:7]))
    assert max(delays[20:]) > 30  # the ceiling reached the cap and stays there
    b.reset()
    assert b.delay() <= 0.5


def test_ten_thousand_agents_do_not_retry_in_lockstep() -> None:
    """After a control-plane restart every agent fails at once; their retries must spread."""
    agents = [Backoff(base_s=0.5, cap_s=60.0) for _ in range(10_000)]  # each seeded by the OS
    for _ in range(6):  # the sixth retry of each: ceiling 0.5 * 2**5 = 16 s
        firsts = [a.delay() for a in agents]
    assert len(set(firsts)) > 9_990  # not a handful of shared values
    # spread over [0, 16 s): no one-second bucket holds more than 2x its fair share
    buckets = [0] * 16
    for d in firsts:
        buckets[min(int(d), 15)] += 1
    assert max(buckets) < 2 * 10_000 / 16
    assert statistics.pstdev(firsts) == pytest.approx(16 / 12**0.5, rel=0.1)  # uniform on [0,16]
    # and two agents' schedules do not march together either
    a, b = Backoff(), Backoff()
    assert [a.delay() for _ in range(10)] != [b.delay() for _ in range(10)]
