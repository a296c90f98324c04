"""A small HTTP/1.1 client for the swarm: keep-alive connections, one request at a time each.

Not a general client. A request is its encoded bytes (`encode_request`); the answer is read by
Content-Length, or chunked, until complete; the status, body and whether the server keeps the
connection come back. There is no pipelining and no redirect, TLS or compression: the swarm
shares a few hundred of these connections among many phones, and per request it costs a few
microseconds of Python where a general client costs a hundred (`phalanx.sim.swarm`).

Every failure that is not an answer is a `TransportError` whose `kind` names it for the stats:
`refused`, `reset`, `closed` (the server closed without answering), `timeout`, `malformed`.
"""

from __future__ import annotations

import asyncio
import socket
import time
from typing import NamedTuple

MAX_HEAD = 64 * 1024  # bytes of status line and headers
MAX_BODY = 16 * 1024 * 1024


class TransportError(Exception):
    def __init__(self, kind: str, detail: str = "") -> None:
        super().__init__(f"{kind}: {detail}" if detail else kind)
        self.kind = kind


class Response(NamedTuple):
    status: int
    body: bytes
    keep_alive: bool


def encode_request(method: str, path: str, host: str, headers: dict[str, str] | None = None,
                   body: bytes | None = None) -> bytes:
    """The bytes of one request; a body gets Content-Type JSON and its Content-Length."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    if body is not None:
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (body or b"")


def _dechunk(buf: bytearray, pos: int) -> tuple[bytes, int] | None:
    """A chunked body starting at `pos`: (body, end), or None while incomplete."""
    parts: list[bytes] = []
    while True:
        eol = buf.find(b"\r\n", pos)
        if eol < 0:
            return None
        try:
            size = int(bytes(buf[pos:eol]).split(b";", 1)[0], 16)
        except ValueError:
            raise TransportError("malformed", "bad chunk size") from None
        if size == 0:
            end = buf.find(b"\r\n\r\n", eol)  # the last chunk, then trailers (if any), CRLF
            return (b"".join(parts), end + 4) if end >= 0 else None
        start, stop = eol + 2, eol + 2 + size
        if len(buf) < stop + 2:
            return None
        parts.append(bytes(buf[start:stop]))
        pos = stop + 2


def parse_response(buf: bytearray) -> tuple[Response, int] | None:
    """The first complete response in `buf` and where it ends, or None while incomplete."""
    head_end = buf.find(b"\r\n\r\n")
    if head_end < 0:
        if len(buf) > MAX_HEAD:
            raise TransportError("malformed", "response head too long")
        return None
    head = bytes(buf[:head_end]).lower()
    if not head.startswith(b"http/1."):
        raise TransportError("malformed", repr(head[:40]))
    try:
        status = int(head[9:12])
    except ValueError:
        raise TransportError("malformed", repr(head[:40])) from None
    keep_alive = not head.startswith(b"http/1.0")
    length, chunked = -1, False
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        value = value.strip()
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding":
            chunked = b"chunked" in value
        elif name == b"connection":
            keep_alive = b"close" not in value and (keep_alive or b"keep-alive" in value)
    start = head_end + 4
    if chunked:
        found = _dechunk(buf, start)
        if found is None:
            return None
        body, end = found
        return Response(status, body, keep_alive), end
    if length < 0:
        length = 0 if status in (204, 304) or 100 <= status < 200 else -1
    if length < 0:
        raise TransportError("malformed", "a body without a length (read to close)")
    if length > MAX_BODY:
        raise TransportError("malformed", f"body of {length} bytes")
    if len(buf) < start + length:
        return None
    return Response(status, bytes(buf[start:start + length]), keep_alive), start + length


class Connection(asyncio.Protocol):
    """One keep-alive connection; `request` sends a request and waits for its answer."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.buffer = bytearray()
        self.waiter: asyncio.Future[Response] | None = None
        self.closed = False
        self.requests = 0  # answered on this connection (0: it is fresh)
        self.used_at = time.monotonic()  # when it last answered (or opened)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.buffer += data
        waiter = self.waiter
        if waiter is None or waiter.done():
            self.close()  # nobody asked: the connection is out of step
            return
        try:
            found = parse_response(self.buffer)
        except TransportError as exc:
            waiter.set_exception(exc)
            self.close()
            return
        if found is not None:
            resp, end = found
            del self.buffer[:end]
            self.requests += 1
            waiter.set_result(resp)
            if not resp.keep_alive:
                self.close()

    def eof_received(self) -> bool:
        self._fail(TransportError("closed", "the server closed the connection"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._fail(TransportError("reset" if exc else "closed", str(exc or "")))

    def _fail(self, error: TransportError) -> None:
        self.closed = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(error)

    async def request(self, data: bytes, timeout_s: float) -> Response:
        if self.closed or self.transport is None:
            raise TransportError("closed", "connection already closed")
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(data)
        try:
            return await asyncio.wait_for(self.waiter, timeout_s)
        except asyncio.TimeoutError:
            self.close()
            raise TransportError("timeout", f"no answer in {timeout_s:g} s") from None
        finally:
            self.waiter = None

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()


async def connect(host: str, port: int, timeout_s: float) -> Connection:
    loop = asyncio.get_running_loop()
    try:
        _, conn = await asyncio.wait_for(loop.create_connection(Connection, host, port),
                                         timeout_s)
    except asyncio.TimeoutError:
        raise TransportError("timeout", f"connect took over {timeout_s:g} s") from None
    except ConnectionRefusedError as exc:
        raise TransportError("refused", str(exc)) from None
    except OSError as exc:
        raise TransportError("reset", f"connect: {exc}") from None
    sock = conn.transport.get_extra_info("socket") if conn.transport else None
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn
