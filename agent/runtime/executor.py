"""The agent's handle on a compute worker subprocess (see `agent.runtime.worker`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import Any

from agent.runtime.workerenv import BACKEND_ENV, CORES_ENV, THREADS_ENV
from engine.memory import with_malloc_tunables

_STARTED: weakref.WeakSet[ComputeWorker] = weakref.WeakSet()  # this process's, until closed

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
               "VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")


class WorkerError(RuntimeError):
    """The worker failed a request or died."""


class Diverged(WorkerError):
    """The worker's result is not finite (wire.messages.NotFinite): the job diverged."""


class ComputeFailed(WorkerError):
    """The engine raised while building the job's model or computing a shard (a ValueError,
    "array is too big", a MemoryError...): an error of the job's inputs, which the same inputs
    give again, unlike a worker that died or a file that could not be read. The agent tries
    again in a fresh worker, and reports the job's failure when the error repeats."""


@dataclass(frozen=True)
class ExecConfig:
    backend: str = "numpy"
    threads: int = 1
    cores: tuple[int, ...] | None = None  # None: wherever the OS likes
    label: str = "all"  # big | little | all | prime ...
    extra_env: tuple[tuple[str, str], ...] = ()  # tests: e.g. a slowdown for one candidate

    def describe(self) -> dict[str, Any]:
        return {"threads": self.threads, "cores": list(self.cores) if self.cores else None,
                "backend": self.backend, "core_set": self.label}


def blas_threads(config: ExecConfig) -> int:
    """numpy's products come out with other bits when OpenBLAS splits them over more threads
    (measured: the digits cnn's shard gradients differ between 1 and 2 threads), and a step
    must not depend on which phone computed a shard (invariant 1): numpy's BLAS always runs on
    one thread, on every phone and in the reference trainer. The chosen thread count is
    torch's (its own job-wide backend)."""
    return 1 if config.backend == "numpy" else config.threads


class ComputeWorker:
    def __init__(self, config: ExecConfig) -> None:
        self.config = config
        env = dict(os.environ)
        env.update({var: str(blas_threads(config)) for var in THREAD_VARS})
        env[THREADS_ENV] = str(config.threads)
        env[BACKEND_ENV] = config.backend
        env["GLIBC_TUNABLES"] = with_malloc_tunables(env)
        env.pop(CORES_ENV, None)
        if config.cores:
            env[CORES_ENV] = ",".join(str(c) for c in config.cores)
        env.update(dict(config.extra_env))
        # the worker imports `agent` the way this process did, installed or from a checkout
        pkg_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (pkg_parent, env.get("PYTHONPATH")) if p)
        self._lock = threading.Lock()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "agent.runtime.worker"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env=env, text=True, bufsize=1,
        )
        _STARTED.add(self)
        hello = self._read()
        self.pinned = bool(hello.get("pinned"))

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.poll()
            raise WorkerError(f"compute worker exited (code {code})")
        try:
            return json.loads(line)
        except ValueError:
            raise WorkerError(f"compute worker said something odd: {line[:200]!r}") from None

    def request(self, req: dict[str, Any]) -> dict[str, Any]:
        with self._lock:
            assert self.proc.stdin is not None
            try:
                self.proc.stdin.write(json.dumps(req) + "\n")
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError) as exc:
                raise WorkerError(f"compute worker is gone: {exc}") from None
            reply = self._read()
        if reply.get("diverged"):
            raise Diverged(str(reply["diverged"]))
        if reply.get("compute_failed"):
            raise ComputeFailed(str(reply["compute_failed"]))
        if not reply.get("ok"):
            raise WorkerError(reply.get("error", "compute worker failed"))
        return reply

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        _STARTED.discard(self)
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(timeout=5)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                try:
                    pipe.close()
                except OSError:
                    pass


def close_all() -> None:
    """Close every compute worker this process started and has not closed: at the agent's
    exit, those a work thread it no longer waits for was still measuring or starting (each is
    asked to quit, and killed after 5 s)."""
    for worker in list(_STARTED):
        worker.close()
