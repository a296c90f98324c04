"""The agent's HTTP transport: connections kept alive between requests (stdlib http.client).

An agent makes three requests a step (work, weights, upload) for as long as it runs; opening a
connection for each, as urllib does, costs a handshake (a TLS one over https), and on the
control plane a new thread of the bulk listener, every time. Here each thread of the agent
keeps one connection per server (scheme, host, port) and reuses it while the server keeps it
open. A request on a reused connection that fails before any answer arrives (the server closed
it while idle) is sent once more on a new connection; every request the agent makes may be
repeated (uploads are idempotent: first result wins, repeats come back as duplicates).
Proxies from the environment (http_proxy) are not used: agents talk to their control plane.
"""

from __future__ import annotations

import http.client
import ssl
import threading
import urllib.parse
from collections.abc import Callable, Sequence
from typing import Any

from wire.buffers import BufferPool
from wire.sockopts import set_socket_buffers

# a request body: bytes, or a message in consecutive parts sent in order without being joined
# (wire.messages.encode_results_parts: a model-sized upload is not copied once more to be sent)
Body = bytes | Sequence[memoryview]
# an answer: (status, headers, body); a big binary body (POOLED_BYTES) is a memoryview
Answer = tuple[int, dict[str, str], bytes | memoryview]
# (method, url, headers, body, timeout, max_bytes) -> answer; tests of the client may swap it
Transport = Callable[[str, str, dict[str, str], "Body | None", float, int], Answer]
_STALE = (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError,
          ConnectionAbortedError)


class _Buffered:
    """Fixed kernel buffers (wire.sockopts) on the socket a connection opens."""

    sock: Any

    def __init__(self, *args: Any, socket_buffer_bytes: int = 0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]
        self.socket_buffer_bytes = socket_buffer_bytes

    def connect(self) -> None:
        super().connect()  # type: ignore[misc]
        set_socket_buffers(self.sock, self.socket_buffer_bytes)


class BufferedHTTPConnection(_Buffered, http.client.HTTPConnection):
    pass


class BufferedHTTPSConnection(_Buffered, http.client.HTTPSConnection):
    pass


class AnswerTooLarge(ValueError):
    pass


# A binary answer at least this big with its length announced (weights, a shard's data) is read
# into a buffer of the agent's own pool (wire.buffers: handed out again only once nothing refers
# to it) rather than a new bytes: malloc maps a 94 MB resnet50 weights message afresh every
# step, ~23,000 zeroed pages a phone a step (docs/benchmarks.md). The pool keeps at most
# ANSWERS_KEPT_BYTES (a phone's memory: two resnet50 messages and a few shard chunks), each
# buffer for a minute after its last use.
POOLED_BYTES = 1 << 20
ANSWERS_KEPT_BYTES = 384 << 20
ANSWERS = BufferPool(max_bytes=ANSWERS_KEPT_BYTES)
_BINARY = "application/octet-stream"


def _read(resp: http.client.HTTPResponse, max_bytes: int) -> bytes | memoryview:
    length = resp.length  # the announced length as http.client parsed it; None: not announced
    if length is not None and length > max_bytes:
        raise AnswerTooLarge(f"the server announced {length} bytes; at most {max_bytes}")
    if resp.status == 200 and length is not None and length >= POOLED_BYTES \
            and (resp.getheader("Content-Type") or "").startswith(_BINARY):
        return _read_into_pool(resp, length)
    data = resp.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise AnswerTooLarge(f"the server sent more than {max_bytes} bytes")
    if resp.length:  # announced, and the connection closed before all of it came
        raise http.client.IncompleteRead(data, resp.length)
    return data


def _read_into_pool(resp: http.client.HTTPResponse, length: int) -> memoryview:
    view = ANSWERS.take(length)
    got = 0
    while got < length:
        n = resp.readinto(view[got:])
        if not n:  # the server closed mid-answer
            raise http.client.IncompleteRead(b"", length - got)
        got += n
    return view


class KeepAliveTransport:
    """A `Transport`: each thread's connections, kept per (scheme, host, port)."""

    def __init__(self, socket_buffer_bytes: int = 0, ca_file: str | None = None) -> None:
        self.socket_buffer_bytes = socket_buffer_bytes
        # https: the system's CAs, or only the lab's own CA when it has one (a self-signed server)
        self.tls = ssl.create_default_context(cafile=ca_file or None)
        self._local = threading.local()  # connections are not shared between threads

    def __call__(self, method: str, url: str, headers: dict[str, str], body: Body | None,
                 timeout: float, max_bytes: int) -> Answer:
        """The answer to one request; AnswerTooLarge when its body would pass `max_bytes`
        (announced or read: a broken or hostile server cannot make the phone hold more)."""
        parts = urllib.parse.urlsplit(url)
        key = (parts.scheme, parts.hostname or "", parts.port)
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        if body is not None and not isinstance(body, bytes):  # parts: sized by the caller
            headers = {**headers, "Content-Length": str(sum(memoryview(p).nbytes for p in body))}
        while True:
            conn, reused = self._connection(key, timeout)
            try:
                conn.request(method, target, body=body, headers=headers)
                resp = conn.getresponse()
                answer = (resp.status, dict(resp.headers.items()), _read(resp, max_bytes))
            except _STALE:
                self._drop(key)
                if reused:
                    continue  # closed by the server while idle: once more, on a new connection
                raise
            except BaseException:
                self._drop(key)  # a timeout or an error mid-answer: the connection is unusable
                raise
            if resp.will_close:
                self._drop(key)
            return answer

    def _connection(self, key: tuple[str, str, int | None],
                    timeout: float) -> tuple[http.client.HTTPConnection, bool]:
        conns: dict[Any, http.client.HTTPConnection] = self._local.__dict__.setdefault("c", {})
        conn = conns.get(key)
        if conn is not None:
            conn.timeout = timeout
            if conn.sock is not None:
                conn.sock.settimeout(timeout)
            return conn, True
        scheme, host, port = key
        make: Callable[..., http.client.HTTPConnection]
        if scheme == "https":
            make = BufferedHTTPSConnection
            extra: dict[str, Any] = {"context": self.tls}
        else:
            make, extra = BufferedHTTPConnection, {}
        conn = make(host, port, timeout=timeout, socket_buffer_bytes=self.socket_buffer_bytes,
                    **extra)
        conns[key] = conn
        return conn, False

    def _drop(self, key: tuple[str, str, int | None]) -> None:
        conn = self._local.__dict__.get("c", {}).pop(key, None)
        if conn is not None:
            conn.close()
