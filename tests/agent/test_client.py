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


class Quiet(BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def answer(self, code: int, body: bytes) -> None:
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def serving(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def answering() -> Iterator[str]:
    """A server answering `/status/<code>` with that code and a JSON detail."""

    class Handler(Quiet):
        def do_GET(self) -> None:  # noqa: N802
            code = int(self.path.rsplit("/", 1)[-1])
            body = json.dumps({"detail": f"you got {code}"}).encode()
            if code == 299:
                code, body = 200, b"<html>not json</html>"
            self.answer(code, body)

    yield from serving(Handler)


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


@pytest.fixture
def echoing() -> Iterator[str]:
    """A server answering a POST with the length and SHA-256 of the body it received."""
    import hashlib

    class Handler(Quiet):
        def do_POST(self) -> None:  # noqa: N802
            body = self.rfile.read(int(self.headers["Content-Length"]))
            self.answer(200, json.dumps({"length": len(body),
                                         "sha256": hashlib.sha256(body).hexdigest(),
                                         "type": self.headers["Content-Type"]}).encode())

    yield from serving(Handler)


def test_an_upload_in_parts_arrives_as_the_joined_message(echoing: str) -> None:
    """The agent sends a results message as its parts (no model-sized join on the phone); the
    server must receive exactly the bytes of the whole message, with its length announced."""
    import hashlib

    import numpy as np

    from engine.step import ShardResult
    from wire.messages import encode_results, encode_results_parts

    rng = np.random.default_rng(3)
    results = [ShardResult(k, rng.standard_normal(300_000).astype(np.float32), 1.5, 3, 8,
                           np.ones(7, np.float32)) for k in (2, 5)]
    whole = encode_results("job-1", 4, results)
    parts = encode_results_parts("job-1", 4, results)
    assert len(parts) > 1
    for bulk in (None, echoing):  # the API port's path and the bulk listener's alike
        got = Client(echoing, "tok").upload_gradients("job-1", 4, parts, bulk_url=bulk)
        assert got == {"length": len(whole), "sha256": hashlib.sha256(whole).hexdigest(),
                       "type": "application/octet-stream"}


@pytest.mark.parametrize("size", [100_000, 0])
def test_connections_use_the_configured_kernel_buffers(echoing: str, size: int) -> None:
    """`socket_buffer_bytes` fixes both kernel buffers of the agent's plain-http connections
    (Linux reports twice the figure set); 0 leaves them to the kernel."""
    from agent.transport import BufferedHTTPConnection

    port = int(echoing.rsplit(":", 1)[1])
    with socket.socket() as fresh:
        default = (fresh.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF),
                   fresh.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF))
    conn = BufferedHTTPConnection("127.0.0.1", port, socket_buffer_bytes=size)
    conn.connect()
    try:
        got = (conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF),
               conn.sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF))
    finally:
        conn.close()
    if size:
        assert got == (2 * size, 2 * size)
    else:  # the kernel's: what a new socket starts with, the send side autotuned on connect
        assert got[1] == default[1] and got[0] >= default[0]


def _counting_server(close_after_answer: bool) -> tuple[type[BaseHTTPRequestHandler], list[int]]:
    """An HTTP/1.1 server that counts the connections it accepts; with `close_after_answer`
    it hangs up after each answer without saying so (as a keep-alive timeout does)."""
    connections: list[int] = []

    class Handler(Quiet):
        protocol_version = "HTTP/1.1"

        def setup(self) -> None:
            super().setup()
            connections.append(1)

        def do_GET(self) -> None:  # noqa: N802
            self.answer(200, json.dumps({"connection": len(connections)}).encode())
            self.close_connection = close_after_answer

    return Handler, connections


def test_requests_reuse_one_kept_alive_connection() -> None:
    handler, connections = _counting_server(close_after_answer=False)
    for url in serving(handler):
        client = Client(url, "tok")
        answers = [client._send("GET", f"/n/{i}").json() for i in range(5)]
    assert answers == [{"connection": 1}] * 5 and len(connections) == 1


def test_a_connection_the_server_closed_while_idle_is_replaced_transparently() -> None:
    handler, connections = _counting_server(close_after_answer=True)
    for url in serving(handler):
        client = Client(url, "tok")
        answers = [client._send("GET", f"/n/{i}").json() for i in range(3)]
    assert answers == [{"connection": 1}, {"connection": 2}, {"connection": 3}]


@pytest.fixture
def oversized() -> Iterator[str]:
    """A server whose every answer is 20 MB of JSON-looking bytes: announced with a
    Content-Length on /announced, streamed until the connection closes on /unannounced."""

    class Handler(Quiet):
        def do_POST(self) -> None:  # noqa: N802
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            body = b"[" + b"0," * (10 * 1024 * 1024) + b"0]"
            if "unannounced" in self.path or self.path.startswith("/u/"):
                self.send_response(200)
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(body)
                self.close_connection = True
            else:
                self.answer(200, body)

    yield from serving(Handler)


@pytest.fixture
def weights_server() -> Iterator[str]:
    """Weights messages of 3 MiB (binary, length announced), each step's bytes its own; on
    /short/ the connection closes 1 MiB before the announced end."""

    class Handler(Quiet):
        protocol_version = "HTTP/1.1"  # kept alive: a pooled read must leave it clean

        def do_GET(self) -> None:  # noqa: N802
            step = int(self.path.rsplit("=", 1)[-1])
            body = bytes([step % 251]) * (3 << 20)
            self.send_response(200)
            self.send_header("Content-Type", "application/json" if self.path.startswith(
                "/json/") else "application/octet-stream")
            # "+N": what int() reads, which the cap must read the same way
            self.send_header("Content-Length", f"+{2 << 30}" if self.path.startswith("/huge/")
                             else str(len(body)))
            self.end_headers()
            if self.path.startswith("/short/"):
                self.wfile.write(body[: 2 << 20])
                self.close_connection = True
                return
            self.wfile.write(body)

    yield from serving(Handler)


def test_a_big_binary_answer_is_read_into_a_buffer_the_agent_had_once_it_is_let_go(
        weights_server: str) -> None:
    """A phone downloads a model-sized weights message every step: into a pooled buffer, so a
    94 MB message is not a fresh mapping of zeroed pages each time; a buffer still referred
    to (a message still being written to the cache) is never reused under it."""
    from agent.transport import ANSWERS
    from wire.buffers import POOLING

    client = Client(weights_server, "phx-dev-x")
    first = client.weights("job-1", 1)
    assert isinstance(first, memoryview) and bytes(first[:1]) == b"\x01"
    kept = client.weights("job-1", 2)  # `first` still referred to: another buffer
    assert bytes(first[:1]) == b"\x01" and bytes(kept[:1]) == b"\x02"
    assert len(first) == len(kept) == 3 << 20
    del first
    reused = ANSWERS.reused
    third = client.weights("job-1", 3)
    assert bytes(third[:1]) == b"\x03" and bytes(third[-1:]) == b"\x03"
    assert bytes(kept[-1:]) == b"\x02"  # the buffer still held was not written over
    if POOLING:
        assert ANSWERS.reused == reused + 1
    assert isinstance(Client(weights_server + "/json", "phx-dev-x").weights("job-1", 5), bytes)
    # a binary answer cut short is a transport error, not a message padded with another
    # step's bytes; an announced length past the cap is refused before anything is held
    with pytest.raises(TransportError, match="IncompleteRead"):
        Client(weights_server + "/short", "phx-dev-x").weights("job-1", 4)
    with pytest.raises(TransportError, match="2147483648 bytes; at most"):
        Client(weights_server + "/huge", "phx-dev-x").weights("job-1", 6)


@pytest.mark.parametrize("prefix", ["", "/u"])
def test_an_answer_larger_than_its_kind_allows_is_refused_not_held(oversized: str,
                                                                   prefix: str) -> None:
    """A heartbeat answer is JSON of a few hundred bytes: 20 MB of it (announced or not) is a
    transport error, read no further than the cap."""
    client = Client(oversized + prefix, "phx-dev-x")
    with pytest.raises(TransportError, match="16777216"):
        client.heartbeat("dev-1", {"telemetry": []})


def test_an_https_agent_never_follows_a_plain_http_bulk_url() -> None:
    """The server names the bulk listener's URL; an agent enrolled over https sends weights
    requests and uploads through the API's https rather than step down to plain http."""
    sent: list[str] = []

    def recording(method, url, headers, body, timeout, max_bytes):  # noqa: ANN001
        sent.append(url)
        return 200, {}, b"{}"

    secure = Client("https://lab.example:8443", "phx-dev-x", transport=recording)
    secure.weights("job-1", 3, bulk_url="http://lab.example:8001")
    secure.upload_gradients("job-1", 3, b"x", bulk_url="http://lab.example:8001")
    secure.weights("job-1", 4, bulk_url="https://lab.example:8444")
    plain = Client("http://lab.example:8000", "phx-dev-x", transport=recording)
    plain.weights("job-1", 3, bulk_url="http://lab.example:8001")
    assert sent == ["https://lab.example:8443/v1/jobs/job-1/weights?step=3",
                    "https://lab.example:8443/v1/jobs/job-1/steps/3/gradients",
                    "https://lab.example:8444/v1/jobs/job-1/weights?step=4",
                    "http://lab.example:8001/v1/jobs/job-1/weights?step=3"]
