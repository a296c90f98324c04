"""Execution choice: candidates from big.LITTLE clusters; profiling keeps the faster config."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.runtime.choice import Measurement, candidates, choose, core_sets
from agent.runtime.execution import ExecutionManager
from agent.runtime.executor import ComputeWorker, ExecConfig
from tests.agent.step_request import make_request, step_zero
from wire.messages import decode_results

S10 = [{"cores": [0, 1, 2, 3]}, {"cores": [4, 5, 6]}, {"cores": [7]}]
SPEC = {"name": "mlp", "model": {"arch": "mlp", "hidden": 256}, "dataset": "digits",
        "global_batch_size": 256, "shards": 2, "epochs": 1, "seed": 3}


def test_core_sets_follow_the_clusters() -> None:
    assert core_sets(S10, set(range(8))) == [
        ("all", tuple(range(8))), ("big", (4, 5, 6, 7)), ("little", (0, 1, 2, 3))]
    # only the cores this process may use count; one cluster means just "all"
    assert core_sets(S10, {0, 1}) == [("all", (0, 1))]


def test_candidates_try_each_core_set_and_backend_first() -> None:
    got = candidates(S10, ["numpy", "torch"], set(range(8)), limit=6)
    # numpy's BLAS always runs on one thread (its bits depend on the thread count)
    assert [(c.backend, c.label, c.threads) for c in got] == [
        ("numpy", "all", 1), ("torch", "all", 8), ("numpy", "big", 1), ("torch", "big", 4),
        ("numpy", "little", 1), ("torch", "little", 4)]
    assert got[2].cores == (4, 5, 6, 7)


def m(label: str, speed: float, power: float | None = None) -> Measurement:
    return Measurement(ExecConfig(label=label), speed, power)


def test_choose_the_fastest_without_a_power_limit() -> None:
    assert choose([m("a", 10, 2), m("b", 30, 6), m("c", 20)]).config.label == "b"


def test_choose_the_most_efficient_under_a_power_limit() -> None:
    results = [m("a", 10, 2.0), m("b", 30, 6.0), m("c", 16, 2.5)]
    assert choose(results, power_limit_w=3.0).config.label == "c"  # 6.4 samples/J beats 5
    assert choose(results, power_limit_w=1.0).config.label == "a"  # none fits: the least power
    assert choose([m("x", 5), m("y", 9)], power_limit_w=3.0).config.label == "y"  # unmetered


def test_choose_needs_something() -> None:
    with pytest.raises(ValueError):
        choose([])


@pytest.fixture
def step_request(tmp_path: Path) -> dict:
    return make_request(step_zero(SPEC), tmp_path, 0)


def test_profiling_keeps_the_faster_of_two_configurations(step_request: dict) -> None:
    fast = ExecConfig(label="fast")
    slow = ExecConfig(label="slow", extra_env=(("PHALANX_AGENT_SLOWDOWN", "6"),))
    manager = ExecutionManager(lambda: [slow, fast], bench_repeats=3)
    try:
        best = manager.profile("k", step_request)
        speeds = {r.config.label: r.samples_per_s for r in manager.results}
        assert best.config == fast, speeds
        assert speeds["slow"] < speeds["fast"]  # the choice is the measured order
        assert manager.report()["samples_per_s"] == pytest.approx(speeds["fast"], rel=0.01)
        # the kept worker is the chosen one, and it computes real steps
        manager.step(step_request)
        results = decode_results(Path(step_request["out_path"]).read_bytes(),
                                 expect_job="job-test", expect_step=0,
                                 n_params=step_request["_n_params"])
        assert [r.shard for r in results] == [0] and results[0].count == 128
        assert manager.worker is not None and manager.worker.config == fast
        assert not manager.needs_profile("k", throttled_now=False, requested=False)
        assert manager.needs_profile("other-model", throttled_now=False, requested=False)
    finally:
        manager.close()


def test_a_candidate_that_fails_is_skipped(step_request: dict) -> None:
    broken = ExecConfig(backend="no-such-backend", label="broken")
    manager = ExecutionManager(lambda: [broken, ExecConfig(label="ok")], bench_repeats=1)
    try:
        assert manager.profile("k", step_request).config.label == "ok"
        assert [r.config.label for r in manager.results] == ["ok"]
    finally:
        manager.close()


def test_the_worker_pins_itself_to_the_cores_it_was_given() -> None:
    worker = ComputeWorker(ExecConfig(threads=1, cores=(0,), label="little"))
    try:
        assert worker.pinned
        with open(f"/proc/{worker.pid}/status") as fh:
            allowed = next(line for line in fh if line.startswith("Cpus_allowed_list"))
        assert allowed.split()[-1] == "0"
    finally:
        worker.close()


def test_throttling_or_a_request_triggers_a_new_profile_but_not_too_often() -> None:
    clock = [0.0]
    manager = ExecutionManager(lambda: [], reprofile_min_s=300, clock=lambda: clock[0])
    manager.worker = ComputeWorker(ExecConfig())
    manager.model_key, manager._profiled_at = "k", 0.0
    try:
        assert not manager.needs_profile("k", throttled_now=False, requested=False)
        assert not manager.needs_profile("k", throttled_now=True, requested=False)  # just done
        clock[0] = 301.0
        assert manager.needs_profile("k", throttled_now=True, requested=False)
        assert manager.needs_profile("k", throttled_now=False, requested=True)
    finally:
        manager.close()


def test_a_job_has_one_backend_numpy_unless_it_asks_for_torch() -> None:
    from agent.runtime.choice import job_backend

    assert job_backend({"placement": {"backend": "any"}}) == "numpy"
    assert job_backend({"placement": {}}) == "numpy"
    assert job_backend(None) == "numpy"
    assert job_backend({"placement": {"backend": "torch"}}) == "torch"
    assert job_backend({"placement": {"backend": "numpy"}}) == "numpy"


CNN = {"name": "cnn", "model": {"arch": "cnn"}, "dataset": "digits", "global_batch_size": 256,
       "shards": 16, "epochs": 1, "seed": 0}


def test_a_numpy_shard_has_the_same_bits_whatever_thread_count_the_phone_chose(
        tmp_path: Path) -> None:
    """Invariant 1 across an execution choice: the digits cnn's shard gradient computed by a
    worker configured for 1 thread, one for 2, and the reference trainer's way, bit for bit
    (OpenBLAS on 2 threads alone gives other bits)."""
    from threadpoolctl import threadpool_limits

    from agent.runtime.executor import blas_threads
    from engine.sampler import select_microbatch
    from engine.step import compute_shard

    job = step_zero(CNN)
    req = {**make_request(job, tmp_path, 3), "op": "step"}
    shard = Path(req["shards"]["3"])
    # four shards held: a 2-thread worker computes two at a time, side by side
    for k in (4, 5, 6):
        req["shards"][str(k)] = make_request(job, tmp_path, k)["shards"][str(k)]
    results = {}
    for threads in (1, 2):
        worker = ComputeWorker(ExecConfig("numpy", threads))
        try:
            out = tmp_path / f"result-{threads}.bin"
            worker.request({**req, "out_path": str(out)})
            bench = worker.request({**req, "op": "bench", "repeats": 1})
        finally:
            worker.close()
        assert bench["samples"] == threads * job.spec.per_shard_batch  # what it does at once
        results[threads] = out.read_bytes()
    assert results[1] == results[2]  # every shard's bytes, in the same order
    decoded = decode_results(results[2])
    assert [r.shard for r in decoded] == [3, 4, 5, 6]
    grads = [decoded[0].grad_sum.tobytes()]
    assert blas_threads(ExecConfig("numpy", 2)) == 1 and blas_threads(ExecConfig("torch", 2)) == 2
    import numpy as np

    with np.load(shard, allow_pickle=False) as npz:
        xs, ys = npz["x"], npz["y"]
    xb, yb = select_microbatch(xs, ys, job.spec.per_shard_batch, job.spec.seed, 0, 3,
                               job.spec.steps_per_epoch)
    with threadpool_limits(limits=1, user_api="blas"):  # as phalanx train --local runs
        ref = compute_shard(job.model, job.state.params, job.state.buffers, xb, yb,
                            job.spec, 0, 3, "numpy")
    assert ref.grad_sum.tobytes() == grads[0]


def test_a_helper_killed_between_steps_is_replaced_and_leaves_no_scratch_files(
        tmp_path: Path) -> None:
    import os
    import signal

    job = step_zero(CNN)
    req = {**make_request(job, tmp_path, 3), "op": "step"}
    for k in (4, 5):
        req["shards"][str(k)] = make_request(job, tmp_path, k)["shards"][str(k)]
    worker = ComputeWorker(ExecConfig("numpy", 2))
    try:
        first = worker.request({**req, "out_path": str(tmp_path / "a.bin")})
        (helper,) = first["helper_pids"]
        os.kill(helper, signal.SIGKILL)  # Android's low-memory killer
        second = worker.request({**req, "out_path": str(tmp_path / "b.bin")})
    finally:
        worker.close()
    assert second["helper_pids"] and second["helper_pids"] != [helper]
    assert (tmp_path / "a.bin").read_bytes() == (tmp_path / "b.bin").read_bytes()
    assert not list(tmp_path.glob(".helper-*"))


def _page_faults(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as fh:  # minflt: the 8th field after the command's ")"
        return int(fh.read().rsplit(")", 1)[1].split()[7])


def _step_faults(req: dict, tunables: str | None, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Page faults of a 2-thread worker and its helper during one step after two."""
    if tunables is None:
        monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    else:
        monkeypatch.setenv("GLIBC_TUNABLES", tunables)
    worker = ComputeWorker(ExecConfig("numpy", 2))
    try:
        first = worker.request(req)
        worker.request(req)  # the first steps size the heap
        pids = [worker.pid, *first["helper_pids"]]
        before = [_page_faults(pid) for pid in pids]
        worker.request(req)
        return [_page_faults(pid) - b for pid, b in zip(pids, before)]
    finally:
        worker.close()


def test_a_workers_steps_reuse_its_memory_instead_of_faulting_in_fresh_pages(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """glibc gave each shard's large arrays back to the kernel and faulted them in again on
    the next shard (~500 page faults a step for the digits cnn, 8,400 for a 32x32 one: 25% of
    its compute, bench/phone_cores.py). The worker and its helpers start with malloc tunables
    that keep them, beside an operator's own GLIBC_TUNABLES, which win where both name one."""
    job = step_zero(CNN)
    req = {**make_request(job, tmp_path, 3), "op": "step"}
    for k in (4, 5, 6):
        req["shards"][str(k)] = make_request(job, tmp_path, k)["shards"][str(k)]
    ours = _step_faults(req, None, monkeypatch)
    beside = _step_faults(req, "glibc.malloc.arena_max=1", monkeypatch)
    theirs = _step_faults(req, "glibc.malloc.mmap_threshold=131072:"
                               "glibc.malloc.trim_threshold=131072",
                          monkeypatch)  # glibc's static defaults (no dynamic threshold)
    # measured alone: 0-1 a process with ours, ~1,100 with glibc's static defaults; a loaded
    # machine added up to ~100 once
    assert len(ours) == 2 and max(ours) < 300 and max(beside) < 300, (ours, beside)
    assert min(theirs) > 500, theirs
