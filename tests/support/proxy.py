"""A TCP proxy of the tests' own: a load balancer in front of API replicas (round robin over
the backends that accept a connection, as a Kubernetes Service spreads new connections over
ready pods) and a link that can be cut (a network partition: every open connection is reset
and new ones are refused until it heals), or that resets the next few connections once their
request arrives (a blip: a middlebox restart, a conntrack entry dropped)."""

from __future__ import annotations

import itertools
import socket
import struct
import threading

from tests.support.server import free_port


class TcpProxy:
    def __init__(self, backends: list[tuple[str, int]]) -> None:
        self.backends = backends
        self.port = free_port()
        self._turn = itertools.count()
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._cut = False
        self._drops = 0
        self.connections = 0  # accepted and forwarded
        self._listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def redis_url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def cut(self) -> None:
        """Partition: reset every open connection, refuse new ones until `heal`."""
        with self._lock:
            self._cut = True
            doomed, self._open = list(self._open), set()
        for sock in doomed:
            _close(sock)

    def heal(self) -> None:
        with self._lock:
            self._cut = False

    def drop_next(self, count: int) -> None:
        """Reset each of the next `count` connections once its first bytes arrive."""
        with self._lock:
            self._drops = count

    def close(self) -> None:
        self.cut()
        _close(self._listener)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._connect, args=(client,), daemon=True).start()

    def _connect(self, client: socket.socket) -> None:
        with self._lock:
            cut = self._cut
            drop, self._drops = self._drops > 0, max(0, self._drops - 1)
        if drop:
            client.recv(1 << 16)
            _close(client)
            return
        upstream = None if cut else self._upstream()
        if upstream is None:
            _close(client)
            return
        with self._lock:
            if self._cut:
                _close(client), _close(upstream)
                return
            self._open.update((client, upstream))
            self.connections += 1
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _upstream(self) -> socket.socket | None:
        """The next backend that accepts a connection (a dead one is skipped)."""
        start = next(self._turn)
        for i in range(len(self.backends)):
            host, port = self.backends[(start + i) % len(self.backends)]
            try:
                return socket.create_connection((host, port), timeout=2)
            except OSError:
                continue
        return None

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            src.settimeout(None)
            while data := src.recv(1 << 20):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._open.discard(src), self._open.discard(dst)
            _close(src), _close(dst)


def _close(sock: socket.socket) -> None:
    """Reset the connection, as a partition's middlebox or a dead peer answers. shutdown()
    first: close() alone leaves a connection open while another thread is blocked in recv on
    it (the pipe of the other direction), and its client would hang."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass
