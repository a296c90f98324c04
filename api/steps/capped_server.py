"""A threading HTTP server with a bound on its connections, for the step's own ports (the bulk
listener and the peer port): a thread per connection up to the bound; past it the connection
is answered by `refuse` and closed at once, without a thread, so idle connections cannot pile up
threads."""

from __future__ import annotations

import socket
import threading
from http.server import ThreadingHTTPServer
from typing import Any


class CappedThreadingHTTPServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type, max_connections: int) -> None:
        self.max_connections = max_connections
        self.open_connections = 0
        self._count = threading.Lock()
        super().__init__(address, handler)

    def refuse(self, request: socket.socket) -> None:
        """What a connection past the bound is told before the close (nothing by default)."""

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._count:
            full = self.open_connections >= self.max_connections
            if not full:
                self.open_connections += 1
        if full:
            self.refuse(request)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread started: this connection is not open after all
            self.connection_closed()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.connection_closed()

    def connection_closed(self) -> None:
        with self._count:
            self.open_connections -= 1
