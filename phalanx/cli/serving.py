"""How `phalanx server` runs uvicorn: SIGTERM, SIGHUP and Ctrl-C stop it alike, within STOP_S.

uvicorn drains the connections before the app's lifespan ends, so a work long poll (up to 30 s)
held the server until its graceful timeout. `Server` first stops every version watcher of its
process (`hotstate.version.stop_waits`): each long poll answers as at its timeout (no work; a
slice not yet applied) and the agent asks again, of the server that comes next. What is still in
flight then (an upload, a download) gets GRACEFUL_S, and is cancelled after.

With --workers N uvicorn's supervisor stops its workers on SIGTERM and SIGINT; `Supervisor` stops
them on SIGHUP too (uvicorn restarts them), and each worker serves with `Server`.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from socket import socket

import uvicorn
from uvicorn.config import STARTUP_FAILURE
from uvicorn.supervisors import multiprocess

log = logging.getLogger("uvicorn.error")

STOP_S = 3  # the promise: from the signal to the process's end (docs/cli.md, "Stopping")
GRACEFUL_S = 2  # what a request still in flight gets, once the long polls have answered


class Server(uvicorn.Server):
    """uvicorn's server, stopped by SIGHUP as by SIGTERM, ending its long polls at once."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        """uvicorn's SIGINT and SIGTERM handling, and SIGHUP the same way: a graceful stop, then
        the signal raised again (the process ends as that signal ends it)."""
        if threading.current_thread() is not threading.main_thread():
            with super().capture_signals():
                yield
            return
        with super().capture_signals():
            hangup = signal.signal(signal.SIGHUP, self.handle_exit)
            try:
                yield
            finally:  # before uvicorn raises the captured signals again
                signal.signal(signal.SIGHUP, hangup)

    async def shutdown(self, sockets: list[socket] | None = None) -> None:
        # imported here: a worker process imports this module before it answers uvicorn's
        # health checks, and the app (which imports it anyway) only later
        from hotstate.version import stop_waits

        stop_waits()  # the long polls answer now, not at the graceful timeout
        await super().shutdown(sockets)


class WorkerProcess(multiprocess.Process):
    """One of uvicorn's worker processes (--workers N), serving with `Server`."""

    @property
    def server(self) -> uvicorn.Server:
        if self._server is None:
            self._server = Server(config=self.config)
        return self._server


class Supervisor(multiprocess.Multiprocess):
    """uvicorn's supervisor of --workers N; SIGHUP stops it as SIGTERM does. Once its workers
    have stopped it ends by the signal it got, as `Server` does: the interpreter's teardown of
    a process that only supervised took seconds more on a loaded machine."""

    stopped_by: signal.Signals | None = None

    def run(self) -> None:
        # uvicorn's supervisor starts (and restarts) its workers by this module-level name
        multiprocess.Process = WorkerProcess  # type: ignore[misc]
        super().run()
        if self.stopped_by is not None:
            logging.shutdown()
            signal.signal(self.stopped_by, signal.SIG_DFL)
            signal.raise_signal(self.stopped_by)

    def _stop(self, sig: signal.Signals) -> None:
        log.info("Received %s, exiting.", sig.name)
        self.stopped_by = sig
        self.should_exit.set()

    def handle_int(self) -> None:
        self._stop(signal.SIGINT)

    def handle_term(self) -> None:
        self._stop(signal.SIGTERM)

    def handle_hup(self) -> None:
        self._stop(signal.SIGHUP)


def serve(config: uvicorn.Config) -> None:
    """What `uvicorn.run` does with `config`, with `Server` and `Supervisor`."""
    if config.workers > 1:
        Supervisor(config, sockets=[config.bind_socket()]).run()
        return
    server = Server(config=config)
    with contextlib.suppress(KeyboardInterrupt):
        server.run()
    if not server.started:
        sys.exit(STARTUP_FAILURE)
