"""The compute worker: a subprocess that runs training steps under one execution choice.

Why a subprocess: numpy's BLAS (OpenBLAS on Termux) sizes its thread pool once, when numpy is
imported, from OPENBLAS_NUM_THREADS / OMP_NUM_THREADS and the CPUs the process may run on.
Changing it later needs threadpoolctl, which the agent may not depend on. So each execution
choice (backend, thread count, core set) is a fresh worker started with those variables set
and `os.sched_setaffinity` applied *before* numpy is imported; torch additionally gets
`torch.set_num_threads`. Switching choice means replacing the worker, which costs one numpy
import (~0.3 s) and happens only when profiling.

Every core, exactly: numpy's BLAS always runs on one thread (a product split over threads
comes out with other bits), so a numpy worker given N threads computes up to N of its shards
side by side: its own share here, the rest in N - 1 helper workers (the same program, one
thread each, started once and kept), each single-threaded, each writing its shards' results to
a file this worker reads back. Processes rather than threads: the engine holds the GIL between
numpy calls, and two threads of one process took turns (1.1-1.5x on 2 cores, measured). Each
shard's result is the one-thread result, bit for bit, whatever N.

Protocol: one JSON object per line on stdin, one reply per line on stdout (stdout carries
nothing else). Bulk data never crosses the pipe: weights, shard data and results are files in
the agent's cache, so no pickling and no copies through the pipe.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agent.config import atomic_write  # stdlib only: safe to import before pinning
from agent.runtime import slowdown
from agent.runtime.executor import (  # stdlib only too
    ComputeFailed,
    ComputeWorker,
    Diverged,
    ExecConfig,
    WorkerError,
)
from agent.runtime.workerenv import BACKEND_ENV, CORES_ENV, THREADS_ENV


def _pin() -> bool:
    cores = os.environ.get(CORES_ENV)
    if not cores or not hasattr(os, "sched_setaffinity"):
        return False
    try:
        os.sched_setaffinity(0, {int(c) for c in cores.split(",")})
    except (OSError, ValueError):
        return False  # not allowed here (some kernels/SELinux): run unpinned, report it
    return True


def _fill_dataset_facts(req: dict[str, Any]) -> None:
    """Older servers may leave the dataset facts out: built-in datasets are known here too."""
    if all(req.get(k) is not None for k in ("n_train", "input_shape", "num_classes")):
        return
    from engine.data import dataset_info

    info = dataset_info(req["spec"]["dataset"])
    req.setdefault("n_train", None)
    req["n_train"] = req["n_train"] or info.n_train
    req["input_shape"] = req.get("input_shape") or list(info.input_shape)
    req["num_classes"] = req.get("num_classes") or info.num_classes


@contextmanager
def engine_errors() -> Iterator[None]:
    """An exception the engine raises building the job's model or computing a shard is the
    job's (ComputeFailed): a function of the spec, the weights and the shard, which the same
    inputs raise again (ValueError, "array is too big", TypeError, MemoryError...). Not so: an
    OSError (the disk, a file), a result that is not finite (NotFinite: the job diverged, its
    own report) and a worker's own failures, which go up as they are."""
    try:
        yield
    except (OSError, WorkerError):
        raise
    except Exception as exc:
        from wire.messages import NotFinite  # numpy: imported after pinning

        if isinstance(exc, NotFinite):
            raise
        public = next(c.__name__ for c in type(exc).__mro__ if not c.__name__.startswith("_"))
        raise ComputeFailed(f"{public}: {exc}") from exc


class Engine:
    """Caches the model, weights and shard arrays between steps of one job."""

    def __init__(self, backend: str, side_by_side: int = 1) -> None:
        self.backend = backend
        self.side_by_side = max(1, side_by_side)  # shards computed at once (numpy only)
        self._helpers: list[ComputeWorker] = []  # started on first use
        self._pool = ThreadPoolExecutor(self.side_by_side - 1, thread_name_prefix="helper") \
            if self.side_by_side > 1 else None
        self._model_key: str | None = None
        self._job: Any = None  # engine.runner.JobModel (numpy is imported only when working)
        self._weights: tuple[str, Any, Any] | None = None
        self._shards: dict[str, tuple[Any, Any]] = {}
        self.held = HeldPartials()

    def prepare(self, req: dict[str, Any]) -> None:
        from engine.runner import job_model

        _fill_dataset_facts(req)
        key = json.dumps([req["job_id"], req["spec"], req["input_shape"], req["num_classes"]],
                         sort_keys=True)
        if key != self._model_key:
            with engine_errors():
                self._job = job_model(req["spec"], req["n_train"], req["input_shape"],
                                      req["num_classes"])
            self._model_key, self._shards = key, {}
        if self._weights is None or self._weights[0] != req["weights_path"]:
            from wire.messages import decode_weights

            with open(req["weights_path"], "rb") as fh:
                _, params, buffers = decode_weights(fh.read(), expect_job=req["job_id"],
                                                    expect_step=req["step"])
            self._weights = (req["weights_path"], params, buffers)

    @property
    def job(self) -> Any:
        assert self._job is not None, "prepare() first"
        return self._job

    def shard(self, path: str) -> tuple[Any, Any]:
        from engine.runner import shard_arrays

        if path not in self._shards:
            self._shards[path] = shard_arrays(path)
        return self._shards[path]

    def compute(self, req: dict[str, Any], shard: int, path: str) -> Any:
        from engine.runner import shard_gradient

        x, y = self.shard(path)
        assert self._job is not None and self._weights is not None
        _, params, buffers = self._weights
        with engine_errors():
            return shard_gradient(self._job, params, buffers, x, y, req["step"], shard,
                                  backend=self.backend)

    def compute_all(self, req: dict[str, Any], ordered: list[tuple[int, str]],
                    dtype: str) -> Computed:
        """Each (shard, data path)'s result, in the given order, as the results message
        carries it in `dtype`; up to `side_by_side` at once: every side_by_side-th pair here,
        the others in the helpers, which send back their shards' bytes, not arrays."""
        n = self.side_by_side
        if self._pool is None or len(ordered) < 2:
            return Computed.of([self.compute(req, k, p) for k, p in ordered], dtype)
        while len(self._helpers) < n - 1:  # a helper inherits this worker's CPU affinity
            self._helpers.append(ComputeWorker(ExecConfig(self.backend, 1)))
        asked = [(i, self._pool.submit(self._in_helper, i, req, ordered[i::n], dtype))
                 for i in range(1, min(n, len(ordered)))]
        own = Computed.of([self.compute(req, k, p) for k, p in ordered[0::n]], dtype)
        entries: list[Any] = [None] * len(ordered)
        segments: list[Any] = [None] * len(ordered)  # each shard's chunks: grad and stats
        entries[0::n] = own.entries
        segments[0::n] = [own.chunks[j : j + 2] for j in range(0, len(own.chunks), 2)]
        for i, future in asked:
            theirs, parts = future.result()
            entries[i::n], segments[i::n] = theirs, [[part] for part in parts]
        return Computed(entries, [c for seg in segments for c in seg], own.n_params,
                        own.n_stats, dtype)

    @property
    def helpers(self) -> list[ComputeWorker]:
        return list(self._helpers)

    def _in_helper(self, index: int, req: dict[str, Any], group: list[tuple[int, str]],
                   dtype: str) -> tuple[list[dict[str, Any]], list[memoryview]]:
        """`group`'s header entries and each shard's bytes, as helper `index` encoded them in
        `dtype` (the same function as here: the same bytes) into a scratch file read back in
        one piece. A helper that died (the low-memory killer) is replaced and asked once more."""
        from wire.messages import segment_bytes

        out = Path(req.get("out_path") or req["weights_path"]).with_name(
            f".helper-{os.getpid()}-{index}.bin")
        shards = {str(k): path for k, path in group}  # a group never names a shard twice
        ask = {**req, "op": "step", "shards": shards, "out_path": str(out), "dtype": dtype,
               "payload_only": True}
        try:
            try:
                reply = self._helpers[index - 1].request(ask)
            except (Diverged, ComputeFailed):
                raise  # the helper is fine; its shard's result is not finite, or is an error
            except WorkerError:
                self._helpers[index - 1].close()
                self._helpers[index - 1] = ComputeWorker(ExecConfig(self.backend, 1))
                reply = self._helpers[index - 1].request(ask)
            payload = memoryview(out.read_bytes())
        finally:
            out.unlink(missing_ok=True)
        entries = reply["entries"]
        if [e["shard"] for e in entries] != [k for k, _ in group] or \
                reply["n_params"] != int(self.job.model.n_params):
            raise WorkerError(f"helper {index} answered for other shards or sizes")
        size = segment_bytes(dtype, reply["n_params"], reply["n_stats"])
        if len(payload) != size * len(group):
            raise WorkerError(f"helper {index} wrote {len(payload)} bytes, not "
                              f"{size * len(group)}")
        return entries, [payload[j * size : (j + 1) * size] for j in range(len(group))]

    def close(self) -> None:
        for helper in self._helpers:
            helper.close()
        self._helpers = []


@dataclass
class Computed:
    """A step's shard results as the results message carries them: header entries and the
    arrays' bytes, in the same order (some views of arrays computed here, some segments a
    helper wrote)."""

    entries: list[dict[str, Any]]
    chunks: list[Any]
    n_params: int
    n_stats: int
    dtype: str

    @classmethod
    def of(cls, results: list[Any], dtype: str) -> Computed:
        from wire.messages import results_payload

        entries, chunks = results_payload(results, dtype)
        return cls(entries, list(chunks), int(results[0].grad_sum.size),
                   int(results[0].stats.size), dtype)

    @property
    def samples(self) -> int:
        return sum(int(e["count"]) for e in self.entries)

    def parts(self, job_id: str, step: int) -> list[memoryview]:
        from wire.messages import join_results_parts

        return join_results_parts(job_id, step, self.dtype, self.n_params, self.n_stats,
                                  self.entries, self.chunks)


class HeldPartials:
    """A step's results computed but not yet uploaded, kept pre-added (engine.tree) between the
    agent's requests: a phone whose shards take longer than one request computes them a request
    at a time and still uploads one partial per node of its share of the step (the nodes of
    `step_shards`, the shards the agent set out to compute), each as soon as it is filled. At
    most ~2 log2(k) vectors are held. A new pass over the step (other `step_shards`) starts
    afresh: whatever was held is computed again, never added twice."""

    def __init__(self) -> None:
        self._pass: str | None = None
        self._partials: list[Any] = []

    def add(self, done: Computed, req: dict[str, Any], spec: Any) -> Computed | None:
        """What to upload now out of `done` and what is held: filled nodes of the share, and
        everything once the request is the pass's last; None: nothing yet."""
        from engine.step import pre_reduce
        from engine.tree import cover
        from wire.messages import decode_results

        job_id, step = req["job_id"], req["step"]
        share = sorted(int(k) for k in req.get("step_shards") or req["shards"])
        this_pass = json.dumps([job_id, step, share])
        if this_pass != self._pass:
            self._pass, self._partials = this_pass, []
        if not self._partials and req.get("last", True) and len(done.entries) == 1:
            return done  # one shard and nothing held: nothing to add
        leaves = decode_results(b"".join(done.parts(job_id, step)))
        partials = pre_reduce(self._partials + leaves, spec.shards, spec.upload_precision)
        if req.get("last", True):
            ready, self._partials = partials, []
        else:
            nodes = set(cover(share, spec.shards))
            ready = [r for r in partials if r.node in nodes]
            self._partials = [r for r in partials if r.node not in nodes]
        if not ready:
            return None
        unchanged = len(ready) == len(leaves) and all(a is b for a, b in zip(ready, leaves))
        return done if unchanged else Computed.of(ready, done.dtype)  # (no re-encoding)


def handle(engine: Engine, req: dict[str, Any]) -> dict[str, Any]:
    engine.prepare(req)
    shards = {int(k): p for k, p in req["shards"].items()}
    # the job's upload precision (its values are already rounded to it: engine.precision)
    dtype = req.get("dtype") or engine.job.spec.upload_precision
    if req["op"] == "bench":
        # a config's speed is what it does with a step's shards: as many as this worker
        # computes at once (the request's shards, repeated when it names fewer)
        pairs = (sorted(shards.items()) * engine.side_by_side)[:engine.side_by_side]
        engine.compute(req, *pairs[0])  # warm-up: first-call allocations, torch init
        best, samples = float("inf"), 0
        for _ in range(max(1, int(req.get("repeats", 2)))):
            started = time.perf_counter()
            done = engine.compute_all(req, pairs, dtype)
            took = time.perf_counter() - started
            took += slowdown.apply(took)
            best = min(best, took)  # the fastest repeat: other load on the phone only adds
            samples = done.samples
        return {"ok": True, "samples": samples, "seconds": best}
    started = time.perf_counter()
    done = engine.compute_all(req, sorted(shards.items()), dtype)
    samples = done.samples
    upload: Computed | None = done
    if req.get("pre_reduce") and not req.get("payload_only"):
        upload = engine.held.add(done, req, engine.job.spec)
    compute_s = time.perf_counter() - started
    slept = slowdown.apply(compute_s)
    reply = {"ok": True, "samples": samples, "seconds": compute_s + slept,
             "compute_s": compute_s, "helper_pids": [h.pid for h in engine.helpers]}
    if req.get("payload_only"):  # a helper's answer to its worker: read back at once
        with open(req["out_path"], "wb") as fh:
            fh.writelines(memoryview(c).cast("B") for c in done.chunks)
        return {**reply, "entries": done.entries, "n_params": done.n_params,
                "n_stats": done.n_stats}
    if upload is None:  # all held until their node is filled: nothing to upload yet
        return {**reply, "held": True}
    # read by the agent at once and made again if lost: no fsync (~5 ms a step here, more on
    # a phone's flash)
    atomic_write(Path(req["out_path"]), upload.parts(req["job_id"], req["step"]), durable=False)
    return reply


def main() -> int:
    pinned = _pin()  # before numpy: OpenBLAS counts the CPUs it may use at import
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything else that prints goes to stderr, never into the protocol
    backend = os.environ.get(BACKEND_ENV, "numpy")
    import numpy  # noqa: F401  (import now, under the thread variables)

    if backend == "torch":
        import torch

        torch.set_num_threads(int(os.environ.get(THREADS_ENV, "1")))
    threads = int(os.environ.get(THREADS_ENV, "1"))
    engine = Engine(backend, side_by_side=threads if backend == "numpy" else 1)
    proto.write(json.dumps({"ready": True, "pinned": pinned, "pid": os.getpid()}) + "\n")
    for line in sys.stdin:
        try:
            req = json.loads(line)
            if req.get("op") == "quit":
                break
            reply = handle(engine, req)
        except Exception as exc:  # report, keep serving: the agent decides what to do
            reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}", **_diverged(exc)}
            if isinstance(exc, ComputeFailed):  # a helper's too
                reply["compute_failed"] = str(exc)
        proto.write(json.dumps(reply) + "\n")
    engine.close()
    return 0


def _diverged(exc: Exception) -> dict[str, str]:
    """A reply's mark that the result is not finite (a helper's too), which the agent reports."""
    from wire.messages import NotFinite  # numpy: imported after pinning, as the engine is

    return {"diverged": str(exc)} if isinstance(exc, (NotFinite, Diverged)) else {}


if __name__ == "__main__":
    sys.exit(main())
