"""The step's bulk transfers on a port of their own: a thread per connection, bodies whole.

A synchronous step moves one model-sized vector down to every agent (weights) and one back up
(gradients), all at once. Through uvicorn a 12.9 MB upload arrives in ~64 KB pieces, each parsed,
copied and flow-controlled on the one event-loop thread; measured, 8 concurrent uploads cost that
thread ~140 ms of CPU against ~45 ms for threads that `readinto` one buffer (the kernel copies
straight into it, without the GIL). A download through uvicorn costs about what a thread's
`sendall` does, but uvloop makes the copy holding the GIL, which stalls every other thread of the
server meanwhile; `sendall` releases it (docs/benchmarks.md).

The listener serves exactly two paths, `POST /v1/jobs/{job_id}/steps/{t}/gradients` and
`GET /v1/jobs/{job_id}/weights?step=t`, with the API routes' auth rule (a device token), size
limit and answers (`api.routes.work.accept_upload` / `serve_weights`), so an agent may use either
port. The work assignment tells agents where it listens (`bulk_url`); an agent that cannot reach
it uses the API port instead.
"""

from __future__ import annotations

import json
import logging
import re
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any, BinaryIO
from urllib.parse import unquote, urlsplit

from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException

from api.app_state import AppState
from api.auth import parse_bearer
from api.deps import check_device
from api.error_responses import error_response
from api.limits import BodyTooLarge
from api.metrics import BULK_REFUSED_CONNECTIONS as REFUSED_CONNECTIONS
from api.metrics import HTTP_LATENCY, HTTP_REQUESTS, UNMATCHED
from api.schemas.common import parse_query
from api.steps.bulk_body import MAX_BODIES
from api.steps.capped_server import CappedThreadingHTTPServer
from api.steps.handlers import accept_upload, serve_weights
from domain.errors import TooManyRequests
from wire.buffers import new_buffer
from wire.sockopts import set_socket_buffers

log = logging.getLogger(__name__)
SOCKET_TIMEOUT_S = 120.0
UPLOAD = re.compile(r"/v1/jobs/([^/]+)/steps/([0-9]{1,18})/gradients")  # a step fits int64
WEIGHTS = re.compile(r"/v1/jobs/([^/]+)/weights")
# the API routes' templates: one series per route whichever port served it
ROUTES = {"POST": "/v1/jobs/{job_id}/steps/{step}/gradients", "GET": "/v1/jobs/{job_id}/weights"}


@dataclass
class Reply:
    status: int
    payload: Any
    headers: dict[str, str] = field(default_factory=dict)
    close: bool = False  # the body was not read: the connection cannot carry another request


def content_length(value: str | None, limit: int) -> int:
    """The body's announced size, refused (411/400/413) unless it is a number within `limit`."""
    if value is None:
        raise HTTPException(411, "Content-Length is required for a gradient upload")
    if not re.fullmatch(r"[0-9]{1,19}", value.strip()):  # str.isdigit() takes "²" and "٣"
        raise HTTPException(400, f"Content-Length {value!r} is not a byte count")
    length = int(value)
    if length > limit:
        raise BodyTooLarge(limit)
    return length


PIECE = 1024 * 1024  # a body arrives in pieces this big, each within the stall deadline


def read_exactly(rfile: BinaryIO, length: int, sock: socket.socket,
                 progress: Callable[[], None] | None = None) -> memoryview | None:
    """`length` bytes into one buffer (None when the client goes away or stalls first).

    What `rfile` has buffered past the headers is taken first; the rest arrives from `sock`
    (the blocking connection under `rfile`) in `recv_into(..., MSG_WAITALL)` calls of a MiB:
    the kernel fills the buffer as the data comes, and the thread takes the GIL back once per
    MiB, not once per socket buffer's worth (hundreds of times for 12.9 MB, each a wait while
    other threads run). `progress` is called after each piece (the connection's deadline moves
    on: a body must keep coming, not merely have started).
    """
    view = new_buffer(length)
    if not length:
        return view
    flags = 0 if isinstance(sock, ssl.SSLSocket) else socket.MSG_WAITALL  # TLS: a record a call
    try:
        if progress is not None:
            progress()
        first = rfile.read1(length)  # type: ignore[attr-defined]
        if not first:
            return None
        view[:len(first)] = first
        got = len(first)
        while got < length:
            if progress is not None:
                progress()
            n = sock.recv_into(view[got:], min(PIECE, length - got), flags)
            if not n:
                return None
            got += n
    except OSError:  # reset, shut down past its deadline, or silent past the socket timeout
        return None
    return view


class Deadlines:
    """Each connection's deadline, kept by one thread: past it the socket is shut down, which
    ends the blocking recv or send its handler thread is in (a per-call timeout cannot stop a
    client that sends one byte per call, or reads one)."""

    def __init__(self, tick_s: float = 0.1) -> None:
        self.tick_s = tick_s
        self._due: dict[socket.socket, float] = {}
        self._lock = threading.Lock()
        self._stopped = threading.Event()
        threading.Thread(target=self._run, name="bulk-deadlines", daemon=True).start()

    def set(self, sock: socket.socket, seconds: float) -> None:
        with self._lock:
            self._due[sock] = time.monotonic() + seconds

    def clear(self, sock: socket.socket) -> None:
        with self._lock:
            self._due.pop(sock, None)

    def stop(self) -> None:
        self._stopped.set()

    def _run(self) -> None:
        while not self._stopped.wait(self.tick_s):
            now = time.monotonic()
            with self._lock:
                late = [sock for sock, due in self._due.items() if due <= now]
                for sock in late:
                    del self._due[sock]
            for sock in late:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass


class DeviceBodies:
    """Upload bodies in flight per device: one device cannot take every body slot."""

    def __init__(self, per_device: int) -> None:
        self.per_device = per_device
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def take(self, device_id: str) -> bool:
        with self._lock:
            if self._held.get(device_id, 0) >= self.per_device:
                return False
            self._held[device_id] = self._held.get(device_id, 0) + 1
            return True

    def give_back(self, device_id: str) -> None:
        with self._lock:
            left = self._held.pop(device_id, 1) - 1
            if left > 0:
                self._held[device_id] = left


class BulkListener:
    """Serves weights and uploads for the app whose `state` it is given (auth, protocol, hooks)."""

    def __init__(self, state: AppState, host: str, port: int, limit: int, *,
                 reuse_port: bool = False, public_url: str | None = None,
                 max_bodies: int = MAX_BODIES, socket_buffer_bytes: int = 0,
                 bounds: Bounds | None = None, tls: ssl.SSLContext | None = None) -> None:
        self.state, self.host, self.requested_port, self.limit = state, host, port, limit
        self.tls = tls
        self.reuse_port, self.public_url = reuse_port, public_url
        self.socket_buffer_bytes = socket_buffer_bytes
        self.bounds = bounds or Bounds()
        # a fleet uploads at the same step boundary: bound the bodies held at once, not the
        # connections (a waiting upload holds its socket, not a model-sized buffer)
        self.bodies = threading.BoundedSemaphore(max_bodies)
        self.device_bodies = DeviceBodies(self.bounds.bodies_per_device)
        self.deadlines: Deadlines | None = None
        self.port: int | None = None
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> int:
        self.deadlines = Deadlines()
        self._server = _Server((self.host, self.requested_port), _Handler, self)
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="bulk-listener",
                                        kwargs={"poll_interval": 0.2}, daemon=True)
        self._thread.start()
        log.info("weights and gradient uploads also on %s:%d", self.host, self.port)
        return self.port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self.deadlines is not None:
            self.deadlines.stop()

    def url_for(self, scheme: str, hostname: str | None) -> str | None:
        """Where an agent that reached the API as `scheme://hostname` fetches weights and sends
        uploads. Never a plain-http address for an agent that came over https (its token would
        travel bare), unless the operator set one; https when this port speaks TLS."""
        if self.public_url:
            return self.public_url.rstrip("/")
        if self.port is None or not hostname or (scheme == "https" and self.tls is None):
            return None
        host = f"[{hostname}]" if ":" in hostname else hostname
        return f"{'https' if self.tls else 'http'}://{host}:{self.port}"

    # -- one request -------------------------------------------------------------------------
    def handle(self, method: str, target: str, headers: Any, rfile: BinaryIO,
               sock: socket.socket) -> Reply | None:
        """The answer to one request; None when the client left mid-body (nobody to answer).
        `sock`: the blocking connection under `rfile`, for reading the body in one call."""
        parts = urlsplit(target)
        upload, weights = UPLOAD.fullmatch(parts.path), WEIGHTS.fullmatch(parts.path)
        if upload is None and weights is None:
            return Reply(404, {"detail": "this port serves only the step's bulk data: POST "
                               "/v1/jobs/{job_id}/steps/{t}/gradients, GET "
                               "/v1/jobs/{job_id}/weights?step=t"}, close=True)
        wanted = "POST" if upload else "GET"
        if method != wanted:
            return Reply(405, {"detail": f"{method} not allowed here: use {wanted}"},
                         {"Allow": wanted}, close=True)
        try:
            principal = self._device(headers)
            if weights:
                reply = self._weights(principal.device_id, unquote(weights.group(1)), parts.query)
                reply.close = headers.get("Content-Length", "0") != "0"  # a body left unread
                return reply
            length = content_length(headers.get("Content-Length"), self.limit)
        except Exception as exc:  # noqa: BLE001 - mapped like the API's handlers, else a 500
            # an upload's body, or a body sent with a GET, is left unread: close after
            return _refusal(exc, close=upload is not None
                            or headers.get("Content-Length", "0") != "0")
        device = principal.device_id
        if not self.device_bodies.take(device):  # refused before a byte of the body is read
            return _refusal(TooManyRequests(
                f"device {device} already has {self.bounds.bodies_per_device} uploads in "
                "flight: send the next when one is answered"), close=True)
        try:
            with self.bodies:
                body = read_exactly(rfile, length, sock, progress=self._stall_deadline(sock))
                if self.deadlines is not None:
                    self.deadlines.clear(sock)  # in whole: what follows is the server's work
                if body is None:
                    return None
                try:
                    answer = accept_upload(self.state, device, unquote(upload.group(1)),
                                           int(upload.group(2)), body)
                except Exception as exc:  # noqa: BLE001
                    return _refusal(exc, close=False)
        finally:
            self.device_bodies.give_back(device)
        return Reply(200, answer)

    def _stall_deadline(self, sock: socket.socket) -> Callable[[], None]:
        def moved() -> None:
            if self.deadlines is not None:
                self.deadlines.set(sock, self.bounds.stall_s)
        return moved

    def _device(self, headers: Any) -> Any:
        auth = self.state.authenticator
        token_hash, principal = auth.cached(parse_bearer(headers.get("Authorization")))
        if principal is None:
            principal = auth.lookup(token_hash)
        return check_device(principal, None)

    def _weights(self, device_id: str, job_id: str, query: str) -> Reply:
        q = parse_query(_WeightsQuery, query)
        # a slice not applied yet is a 409 here at once: phones wait for one on the API port
        payload, headers = serve_weights(self.state, device_id, job_id, q.step, q.slice)
        return Reply(200, payload, {"Content-Type": "application/octet-stream", **headers})


class _WeightsQuery(BaseModel):
    step: int = Field(ge=0)
    slice: int | None = Field(None, ge=0)


@dataclass(frozen=True)
class Bounds:
    """What one client may hold of the listener (issue: a thread per idle connection, a body
    trickled forever, one device taking every body slot)."""

    max_connections: int = 1024  # past it a new connection is refused at once, without a thread
    header_timeout_s: float = 30.0  # a request's headers (or a kept-alive wait) within this
    stall_s: float = 10.0  # each MiB of a body or an answer within this (>= ~100 KiB/s)
    bodies_per_device: int = 2  # upload bodies one device may have in flight


def _refusal(exc: Exception, close: bool) -> Reply:
    mapped = error_response(exc)
    if mapped is None:
        log.exception("bulk request failed", exc_info=exc)
        return Reply(500, {"detail": "internal error"}, close=True)
    status, detail, extra = mapped
    return Reply(status, {"detail": detail}, extra, close=close)


_BUSY_BODY = b'{"detail":"the bulk port serves its maximum of connections: retry shortly"}'
BUSY = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        b"Retry-After: 1\r\nConnection: close\r\nContent-Length: "
        + str(len(_BUSY_BODY)).encode() + b"\r\n\r\n" + _BUSY_BODY)


class _Server(CappedThreadingHTTPServer):
    request_queue_size = 256  # a whole fleet uploads at the same step boundary

    def __init__(self, address: tuple[str, int], handler: type, listener: BulkListener) -> None:
        self.listener = listener
        super().__init__(address, handler, listener.bounds.max_connections)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        tls = self.listener.tls
        if tls is not None:  # the handshake in this connection's thread, within the header deadline
            try:
                request.settimeout(self.listener.bounds.header_timeout_s)
                request = tls.wrap_socket(request, server_side=True)
            except OSError:  # ssl.SSLError too: plain http, a bad or a slow handshake
                self.connection_closed()
                return
        super().process_request_thread(request, client_address)

    def refuse(self, request: socket.socket) -> None:
        REFUSED_CONNECTIONS.labels("max_connections").inc()
        if self.listener.tls is not None:
            return  # no handshake here (a thread per connection is what the cap bounds): the
            # close reads as a reset, which the agent retries on this port
        try:  # a 503 the agent retries (a bare close would read as a port that is gone)
            request.settimeout(0.1)
            request.sendall(BUSY)
        except OSError:
            pass

    def server_bind(self) -> None:
        # several uvicorn worker processes each run a listener on the same port
        if self.listener.reuse_port and hasattr(socket, "SO_REUSEPORT"):
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        # set on the listening socket, before listen(): accepted connections inherit the sizes,
        # and the receive window's scale is fixed at the handshake
        set_socket_buffers(self.socket, self.listener.socket_buffer_bytes)
        super().server_bind()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: an agent's next upload reuses the connection
    disable_nagle_algorithm = True  # a small answer after its headers goes out at once
    server: _Server

    def setup(self) -> None:
        super().setup()
        self.deadlines = self.server.listener.deadlines
        self.bounds = self.server.listener.bounds
        self._await_request()
        # A client that stalls mid-request frees its thread after SOCKET_TIMEOUT_S, kept by the
        # kernel (SO_RCVTIMEO/SO_SNDTIMEO) on a blocking socket:
        # a 12.9 MB answer is then one send() and a body one MSG_WAITALL recv, where Python's
        # timeout mode (a non-blocking socket polled in a loop) takes the GIL back per piece.
        self.connection.settimeout(None)
        timeval = struct.pack("ll", int(SOCKET_TIMEOUT_S), 0)
        for option in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
            self.connection.setsockopt(socket.SOL_SOCKET, option, timeval)

    def do_POST(self) -> None:  # noqa: N802 - BaseHTTPRequestHandler's naming
        self._serve()

    do_GET = do_PUT = do_DELETE = do_PATCH = do_HEAD = do_POST  # noqa: N815

    def _await_request(self) -> None:
        if self.deadlines is not None:
            self.deadlines.set(self.connection, self.bounds.header_timeout_s)

    def finish(self) -> None:
        if self.deadlines is not None:
            self.deadlines.clear(self.connection)
        super().finish()

    def _serve(self) -> None:
        started = time.perf_counter()
        if self.deadlines is not None:  # headers in; the body and the answer set their own
            self.deadlines.clear(self.connection)  # (waiting for a body slot is not the client's)
        reply = self.server.listener.handle(self.command, self.path, self.headers, self.rfile,
                                            self.connection)
        if reply is None:
            self.close_connection = True
            return
        raw = isinstance(reply.payload, (bytes, bytearray, memoryview))
        body = reply.payload if raw else json.dumps(  # byte for byte what Starlette sends
            reply.payload, ensure_ascii=False, separators=(",", ":")).encode()
        self.send_response(reply.status)
        if "Content-Type" not in reply.headers:
            self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for name, value in reply.headers.items():
            self.send_header(name, value)
        if reply.close:
            self.send_header("Connection", "close")
            self.close_connection = True
        try:
            self.end_headers()
            if self.command != "HEAD":
                if self.deadlines is not None:  # an answer must keep going out too
                    pieces = max(1, -(-len(body) // PIECE))
                    self.deadlines.set(self.connection, self.bounds.stall_s * pieces)
                self.wfile.write(body)
        except OSError:  # the agent went away mid-answer (killed, network lost): nothing to do
            self.close_connection = True
        self._await_request()  # the next request on this kept-alive connection
        route = ROUTES.get(self.command, UNMATCHED) if reply.status not in (404, 405) else UNMATCHED
        HTTP_REQUESTS.labels(self.command, route, str(reply.status)).inc()
        HTTP_LATENCY.labels(self.command, route).observe(time.perf_counter() - started)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        log.debug("bulk listener: " + format, *args)
