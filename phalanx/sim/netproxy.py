"""A phone's network link: a TCP forwarder that can be cut, for the "loses network" fault.

The simulated phone's agent talks to the control plane through its own `NetLink`. While the link
is down every open connection is reset and new ones are closed on accept, which is what an agent
sees when Wi-Fi drops; bringing it up again lets the agent's backoff reconnect.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import struct
import threading
from urllib.parse import urlsplit


class NetLink:
    def __init__(self, upstream_url: str) -> None:
        parts = urlsplit(upstream_url)
        self.upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.scheme = parts.scheme or "http"
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.2)
        self.port = self._listener.getsockname()[1]
        self.online = True
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept_loop, name=f"netlink-{self.port}",
                                        daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def set_online(self, online: bool) -> None:
        self.online = online
        if not online:
            with self._lock:
                conns, self._open = list(self._open), set()
            for conn in conns:
                _close(conn)

    def close(self) -> None:
        self._stop.set()
        self.set_online(False)
        self._thread.join(timeout=2)
        _close(self._listener)

    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            if not self.online:
                _close(client)
                continue
            try:
                upstream = socket.create_connection(self.upstream, timeout=5)
            except OSError:
                _close(client)
                continue
            with self._lock:
                self._open.update((client, upstream))
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        """Copy bytes both ways; an EOF is passed on as a half-close, so a response still in
        flight is delivered. Only a cut link (`set_online(False)`) resets connections."""
        sel = selectors.DefaultSelector()
        try:
            for sock, other in ((a, b), (b, a)):
                sock.setblocking(False)
                sel.register(sock, selectors.EVENT_READ, other)
            open_sides = 2
            while open_sides and not self._stop.is_set() and self.online:
                for key, _ in sel.select(timeout=0.5):
                    src, dst = key.fileobj, key.data
                    try:
                        data = src.recv(65536)  # type: ignore[union-attr]
                    except BlockingIOError:
                        continue
                    if not data:
                        sel.unregister(src)
                        open_sides -= 1
                        with contextlib.suppress(OSError):
                            dst.shutdown(socket.SHUT_WR)
                        continue
                    dst.setblocking(True)
                    dst.sendall(data)
                    dst.setblocking(False)
        except (OSError, ValueError):
            pass
        finally:
            sel.close()
            with self._lock:
                cut = a not in self._open
                self._open.discard(a)
                self._open.discard(b)
            for sock in (a, b):
                _close(sock, reset=cut)


def _close(sock: socket.socket, reset: bool = True) -> None:
    if reset:  # RST, as when the network goes away; a clean close lets queued bytes drain
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()
