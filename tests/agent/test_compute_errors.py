"""A compute error that will repeat fails the job with its reason; a transient one is retried
(issue 42, item 6). The worker tells an error the engine raises on the job's inputs
(ComputeFailed: a ValueError, an IndexError, a MemoryError... the same inputs raise it again)
from its own failures (a file it cannot read, a worker that died: WorkerError); the work loop
tries a compute error again in a fresh worker and reports it once it repeats, the same, on the
same step; the real agent against the real server fails a job whose every compute runs out of
memory, with numpy's words in the job's reason (before, the phone retried it for ever and the
job held its phones Running)."""

from __future__ import annotations

import resource
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from agent.runtime.execution import ExecutionManager
from agent.runtime.executor import ComputeFailed, ComputeWorker, ExecConfig, WorkerError
from agent.runtime.state import AgentState
from agent.runtime.work import COMPUTE_TRIES, WorkLoop
from tests.agent import live
from tests.agent import phone as phone_module
from tests.agent.helpers import REPO
from tests.agent.step_request import make_request, step_zero
from tests.support.env import without_settings
from tests.support.server import LiveServer

SPEC = {"name": "mlp", "model": {"arch": "mlp", "hidden": 16}, "dataset": "digits",
        "global_batch_size": 64, "shards": 2, "epochs": 1, "seed": 3}


@pytest.fixture
def request_(tmp_path: Path) -> dict[str, Any]:
    return {**make_request(step_zero(SPEC), tmp_path, 0), "op": "step"}


@pytest.fixture
def worker() -> Iterator[ComputeWorker]:
    w = ComputeWorker(ExecConfig())
    yield w
    w.close()


@pytest.mark.parametrize("change, error", [
    ({"num_classes": 2}, "IndexError: index "),  # labels past the model's classes
    ({"input_shape": [1, 4, 4]}, "ValueError: matmul: "),  # weights of another shape
    ({"spec": {**SPEC, "model": {"arch": "mlp", "hidden": 17}}}, "ValueError: cannot reshape"),
])
def test_an_error_the_engine_raises_on_the_inputs_is_a_compute_failure_and_a_file_is_not(
        worker: ComputeWorker, request_: dict[str, Any], tmp_path: Path,
        change: dict[str, Any], error: str) -> None:
    for _ in range(2):  # the same inputs, the same error; the worker serves on
        with pytest.raises(ComputeFailed) as failed:
            worker.request({**request_, **change})
        assert str(failed.value).startswith(error), failed.value
    # a file the worker cannot read (the cache, the disk) is no error of the job's
    for gone in ({"weights_path": str(tmp_path / "gone.bin")},
                 {"shards": {"0": str(tmp_path / "gone.npz")}}):
        with pytest.raises(WorkerError, match="FileNotFoundError") as failed:
            worker.request({**request_, **gone})
        assert not isinstance(failed.value, ComputeFailed)
    assert worker.request(request_)["ok"]


def test_when_no_candidate_computes_the_shard_profiling_raises_the_compute_failure(
        request_: dict[str, Any]) -> None:
    manager = ExecutionManager(lambda: [ExecConfig(label="a"), ExecConfig(label="b")],
                               bench_repeats=1)
    try:
        with pytest.raises(ComputeFailed, match="IndexError"):
            manager.profile("k", {**request_, "num_classes": 2})
        assert manager.profile("k", request_).config.label in ("a", "b")  # fine inputs: fine
    finally:
        manager.close()


# -- the work loop's rule, with a scripted worker ------------------------------------------

class Scripted:
    """An ExecutionManager whose steps raise what the test scripts, one per try."""

    def __init__(self, *outcomes: BaseException | None) -> None:
        self.outcomes = list(outcomes)
        self.closed = 0

    def ready(self) -> bool:
        return True

    def step(self, req: dict[str, Any]) -> dict[str, Any]:
        outcome = self.outcomes.pop(0)
        if outcome is not None:
            raise outcome
        return {"held": True}  # computed, held for a later request: nothing to upload

    def close(self) -> None:
        self.closed += 1


class Reports:
    def __init__(self) -> None:
        self.sent: list[tuple[str, int, int, str]] = []
        self.kinds: list[str] = []

    def report_diverged(self, job_id: str, step: int, shard: int, reason: str,
                        kind: str = "diverged") -> dict:
        self.sent.append((job_id, step, shard, reason))
        self.kinds.append(kind)
        return {"failed": True}


class Loop(WorkLoop):
    def _request(self, a: Any, job: str, step: int, shards: list[int]) -> dict[str, Any]:
        return {"job_id": job, "step": step}

    def _ensure_choice(self, a: Any, req: dict[str, Any]) -> None:
        pass  # profiling raises as a step does (above)


def tries(execution: Scripted, steps: list[int] | None = None) -> tuple[Reports, list[str]]:
    """Each scripted outcome tried in turn (at step 5, or at `steps`), as the loop would after
    its backoff."""
    client = Reports()
    loop = Loop(client, "dev-1", SimpleNamespace(throttle_events=0), AgentState(),  # type: ignore[arg-type]
                None, None, execution)  # type: ignore[arg-type]
    seen = []
    for step in steps or [5] * len(execution.outcomes):
        a = SimpleNamespace(job_id="job-1", step=step)
        try:
            seen.append("done" if loop._compute_and_upload(a, "job-1", step, [3], [3])
                        else "stop")
        except WorkerError as exc:  # the loop's backoff, then the step again
            seen.append(type(exc).__name__)
    return client, seen


OOM = "MemoryError: Unable to allocate 1.00 GiB for an array with shape (65536, 4096)"


def test_the_same_compute_error_on_every_try_fails_the_job_with_it_and_nothing_else_does(
        ) -> None:
    execution = Scripted(*[ComputeFailed(OOM) for _ in range(COMPUTE_TRIES)])
    client, seen = tries(execution)
    assert seen == ["ComputeFailed"] * (COMPUTE_TRIES - 1) + ["stop"]
    ((job, step, shard, reason),) = client.sent
    assert (job, step, shard) == ("job-1", 5, 3)
    assert reason == f"shard 3 cannot be computed: {OOM} (the same on {COMPUTE_TRIES} tries)"
    assert client.kinds == ["compute_error"]
    assert execution.closed == COMPUTE_TRIES  # every try in a fresh worker
    transient: list[tuple[list[BaseException | None], list[int] | None]] = [
        # out of memory once: the next try computes
        ([ComputeFailed(OOM), None, ComputeFailed(OOM), ComputeFailed(OOM)], None),
        # not the same error twice running
        ([ComputeFailed(OOM), ComputeFailed("ValueError: x"), ComputeFailed(OOM),
          ComputeFailed("ValueError: x")], None),
        # the worker killed (Android's low-memory killer), again and again: the phone's
        ([WorkerError("compute worker exited (code -9)")] * (COMPUTE_TRIES + 2), None),
        # the same error at another step counts afresh
        ([ComputeFailed(OOM)] * (2 * COMPUTE_TRIES - 2),
         [5] * (COMPUTE_TRIES - 1) + [6] * (COMPUTE_TRIES - 1)),
    ]
    for outcomes, steps in transient:
        client, seen = tries(Scripted(*outcomes), steps)
        assert client.sent == [] and "stop" not in seen, (outcomes, seen)


# -- the real agent, the real server --------------------------------------------------------

@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    yield from live.live_server(tmp_path_factory.mktemp("server"))


AGENT_MEMORY = 1536 * 2**20  # address space: numpy and the engine fit, a 2 GiB array does not
# a phone that says it has 64 GiB, half of it usable; a micro-batch of 2048 samples whose
# 4096-channel conv output is 2 GiB: within what the phone says, more than its agent may take
MEMINFO = "MemTotal:       67108864 kB\nMemFree:        60000000 kB\nMemAvailable:   60000000 kB"
BIG = {"name": "oom", "model": {"layers": [
    {"type": "conv2d", "out_channels": 4096, "kernel": 1}, {"type": "relu"},
    {"type": "global_avgpool"}, {"type": "dense", "units": 3}]},
    "dataset": "synthetic:1x8x8:3:4096", "global_batch_size": 2048, "shards": 1, "epochs": 1,
    "seed": 0, "placement": {"min_devices": 1, "max_devices": 1}}


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (AGENT_MEMORY, AGENT_MEMORY))


def test_a_job_whose_every_compute_runs_out_of_memory_fails_with_the_reason(
        server: LiveServer, tmp_path: Path, cool_phone: Path) -> None:
    phone_module.write(cool_phone, "/proc/meminfo", MEMINFO)
    phone = live.enroll(server, tmp_path, cool_phone)
    # one BLAS thread in the agent too (its workers set their own): its address space is
    # the interpreter's and numpy's, whatever the number of cores
    env = {**without_settings(), "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1",
           "PHALANX_SYSFS_ROOT": str(cool_phone), "OPENBLAS_NUM_THREADS": "1",
           "OMP_NUM_THREADS": "1"}
    with phone.log.open("ab") as log:  # the agent (and its workers) short of memory
        phone.process = subprocess.Popen(
            [sys.executable, "-m", "agent", "run", "--config", str(phone.config)], cwd=REPO,
            env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_limit_memory)
    try:
        phone.wait("Ready", lambda: phone.device()["state"] == "Ready")
        spec = {**BIG, "placement": {**BIG["placement"], "selector": {"phone": phone.label}}}
        job_id = live.submit(server, spec)
        done = phone.wait("the job to fail", lambda: (
            (j := live.job(server, job_id))["state"] in ("Succeeded", "Failed") and j),
            timeout=120)
    finally:
        phone.stop()
    assert done["state"] == "Failed", done
    assert "shard 0 cannot be computed: MemoryError: Unable to allocate 2.00 GiB" in \
        done["reason"], done["reason"]
    assert f"the same on {COMPUTE_TRIES} tries" in done["reason"]
    assert phone.device_id in done["reason"]
    # the reason says what it is, not a divergence's advice
    assert done["reason"].startswith("cannot compute step 0") and "learning rate" not in \
        done["reason"], done["reason"]
    log = phone.log.read_text()
    assert log.count("the compute failed (MemoryError") == COMPUTE_TRIES - 1, log
    assert "Traceback" not in log
