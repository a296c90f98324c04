"""The replica's peer port: the upload bodies it keeps (hotstate.bodies), for whoever applies
their steps. One path, `GET /bodies/{id}` (`?range=start-stop`: those bytes of it, what a
sliced step's task reads); the id is the capability (128 random bits, known
only through Redis). Not for phones: bind it where the workers and the other replicas reach it
(`PHALANX_PEER_HOST`, by default this host's name as it resolves: the pod's or container's
address in Kubernetes and compose).
"""

from __future__ import annotations

import logging
import re
import socket
import struct
import threading
from http.server import BaseHTTPRequestHandler
from typing import Any

from api.steps.capped_server import CappedThreadingHTTPServer
from hotstate.bodies import PEER_HEADER, SHELF, BodyShelf

log = logging.getLogger(__name__)
BODY = re.compile(r"/bodies/([0-9a-f]{32})(?:\?range=(\d{1,15})-(\d{1,15}))?")
SEND_TIMEOUT_S = 60.0
MAX_CONNECTIONS = 256


def advertised_host(configured: str | None) -> str:
    """The address peers reach this replica at: the setting, else this host's name resolved
    (loopback when it does not resolve)."""
    if configured:
        return configured
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


class PeerListener:
    def __init__(self, host: str, port: int, shelf: BodyShelf = SHELF,
                 capacity_bytes: int | None = None) -> None:
        self.host, self.requested_port, self.shelf = host, port, shelf
        self.capacity_bytes = capacity_bytes
        self._server: _Server | None = None

    def start(self) -> str:
        """Serve; returns the address peers use (`host:port`) and puts the shelf to use."""
        self._server = _Server((self.host, self.requested_port), _Handler, self.shelf)
        port = self._server.server_address[1]
        address = f"[{self.host}]:{port}" if ":" in self.host else f"{self.host}:{port}"
        threading.Thread(target=self._server.serve_forever, name="peer-listener",
                         kwargs={"poll_interval": 0.2}, daemon=True).start()
        self.shelf.serve_at(address, self.capacity_bytes)
        log.info("upload bodies served to peers on %s", address)
        return address

    def stop(self) -> None:
        self.shelf.serve_at(None)
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _Server(CappedThreadingHTTPServer):
    """Appliers keep one connection per replica: MAX_CONNECTIONS is plenty."""

    request_queue_size = 64

    def __init__(self, address: tuple[str, int], handler: type, shelf: BodyShelf) -> None:
        self.shelf = shelf
        super().__init__(address, handler, MAX_CONNECTIONS)

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("peer connection from %s ended", client_address, exc_info=True)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # one kept-alive connection per applier
    disable_nagle_algorithm = True
    server: _Server

    def setup(self) -> None:
        super().setup()
        # blocking socket with a kernel timeout: a 12.9 MB body is one send() without the GIL
        self.connection.settimeout(None)
        timeval = struct.pack("ll", int(SEND_TIMEOUT_S), 0)
        for option in (socket.SO_RCVTIMEO, socket.SO_SNDTIMEO):
            self.connection.setsockopt(socket.SOL_SOCKET, option, timeval)

    def do_GET(self) -> None:  # noqa: N802 - BaseHTTPRequestHandler's naming
        match = BODY.fullmatch(self.path)
        body = self.server.shelf.get(match.group(1)) if match else None
        if body is not None and match and match.group(2) is not None:  # a slice's range of it
            start, stop = int(match.group(2)), int(match.group(3))
            body = body[start:stop] if start <= stop <= body.nbytes else None
        if body is None:
            self.send_response(404)
            self._identify()
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        self.send_response(200)
        self._identify()
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(body.nbytes))
        try:
            self.end_headers()
            self.wfile.write(body)
        except OSError:
            self.close_connection = True

    def _identify(self) -> None:
        """Which replica answers: a fetcher that reached something else (a wrong advertised
        address) treats the replica as unreachable instead of its bodies as gone."""
        self.send_header(PEER_HEADER, self.server.shelf.address or "")

    def do_POST(self) -> None:  # noqa: N802
        self.send_response(405)
        self.send_header("Content-Length", "0")
        self.send_header("Connection", "close")
        self.close_connection = True
        self.end_headers()

    do_PUT = do_DELETE = do_PATCH = do_POST  # noqa: N815

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        log.debug("peer listener: " + format, *args)
