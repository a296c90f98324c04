"""The processes that apply steps keep each step's big arrays in the heap (engine.memory)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from engine.memory import MALLOC_TUNABLES
from tests.e2e.cluster import Cluster
from tests.support.env import ADMIN_TOKEN
from tests.support.server import REPO_ROOT

OURS = MALLOC_TUNABLES.split(":")

# steps the way a server takes them (api.steps.protocol.store_results: each phone's upload
# received into a buffer from the pool, kept as it came) and applies them
# (scheduler.tasks.steps.run_apply_step: state t + 1 and its weights message), eight phones of a
# mobilenet_v1-sized vector; prints the process's page faults and buffers reused a step
APPLY_STEPS = textwrap.dedent("""
    import json, sys, tempfile
    from pathlib import Path
    import numpy as np
    from api.process import tune_interpreter
    from domain.settings import Settings
    from api.steps.protocol import store_results
    from domain.store.db import make_engine, make_session_factory, transaction, upgrade
    from domain.store.models import Device, Job
    from engine.jobinfo import job_info
    from engine.step import ShardResult
    from hotstate.blobs import MemoryBlobStore
    from scheduler.context import SchedulerContext, Tuning
    from scheduler.tasks.reconcile import run_reconcile, run_reconcile_job
    from scheduler.tasks.steps import run_apply_step
    from wire.buffers import BUFFERS, new_buffer
    from wire.messages import decode_results, encode_results

    def faults():
        with open("/proc/self/stat") as fh:  # minflt: the 8th field after the command's ")"
            return int(fh.read().rsplit(")", 1)[1].split()[7])

    root = Path(tempfile.mkdtemp())
    url = f"sqlite:///{root / 'db.sqlite'}"
    upgrade(url)
    settings = Settings(database_url=url, data_dir=root, buffer_pool_mb=int(sys.argv[1]))
    tune_interpreter(settings)
    ctx = SchedulerContext(settings, make_session_factory(make_engine(url)), MemoryBlobStore(),
                           tuning=Tuning())
    spec = {"name": "m", "model": {"arch": "mobilenet_v1"}, "dataset": "synthetic:3x32x32:10:4096",
            "global_batch_size": 32, "shards": 8, "epochs": 100, "seed": 0,
            "checkpoint_every": 100000, "placement": {"min_devices": 1, "max_devices": 1}}
    with transaction(ctx.session_factory) as s:
        s.add(Device(id="dev-m", name="m", state="Ready", lease_renewed_at=ctx.clock(),
                     capabilities={"compute_class": {"fingerprint": "0123456789abcdef"}}))
        job = Job(name="m", spec=spec, state="Pending", total_steps=job_info("m", spec, root).total_steps)
        s.add(job)
        s.flush()
        job_id = job.id
    run_reconcile(ctx)
    run_reconcile_job(ctx, job_id)
    info = job_info(job_id, spec, root)
    grad = np.full(info.model.n_params, 1e-3, np.float32)
    stats = np.zeros(info.model.n_stats, np.float32)
    per_step = []
    for step in range(10):
        sent = [encode_results(job_id, step, [ShardResult(k, grad, 1.0, 0, 4, stats)]) for k in range(8)]
        before, reused = faults(), BUFFERS.reused
        for k, message in enumerate(sent):
            body = new_buffer(len(message))
            body[:] = message
            store_results(ctx.blobs, job_id, step, body, decode_results(body))
            del body
        assert run_apply_step(ctx, job_id, step) == "applied"
        per_step.append((faults() - before, BUFFERS.reused - reused))
    print(json.dumps(per_step))
""")


def _python(code: str, *args: str, **env: str) -> str:
    """The last line `code` prints in a fresh interpreter on this checkout, started with no
    malloc settings of the test process's (GLIBC_TUNABLES, MALLOC_*) but `env`'s."""
    clean = {k: v for k, v in os.environ.items()
             if k != "GLIBC_TUNABLES" and not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", code, *args],
                         env={**clean, **env, "PYTHONPATH": str(REPO_ROOT)},
                         capture_output=True, text=True, timeout=300, check=True)
    return out.stdout.splitlines()[-1]


def _steps(pool_mb: int) -> list[tuple[int, int]]:
    """(page faults, buffers reused) a step, after three steps that size the pool and heap."""
    return [tuple(s) for s in json.loads(_python(APPLY_STEPS, str(pool_mb)))[3:]]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/stat")
def test_a_step_receives_and_applies_into_buffers_it_had_already_instead_of_fresh_pages() -> None:
    """Every step's eight uploads (12.9 MB each), state (25.7 MB) and weights message arrive in
    buffers of the steps before, so the server faults in no fresh pages for them: measured, a few
    page faults a step with the pool, thousands to ~30,000 without (glibc's heuristics decide
    which steps: ~2,400 a step in the server at 8 agents, clear_page ~5% of its CPU)."""
    pooled = _steps(pool_mb=1024)
    assert all(reused >= 10 for _, reused in pooled), pooled  # 8 uploads, a state, a message
    # a fresh 12.9 MB buffer alone faults in ~3,150 pages; measured: 1-15 a step pooled, and
    # 3-1,261 (536, 817, 856, 1,261 in four of the seven steps) with PHALANX_BUFFER_POOL_MB=0
    assert max(faults for faults, _ in pooled) < 300, pooled


def _keep_in_a_process(operators: str | None, **old: str) -> dict[str, object]:
    """keep_big_blocks() in a fresh process started with `operators` as GLIBC_TUNABLES (and
    glibc's older variables `old`)."""
    code = ("import json, os; from engine.memory import keep_big_blocks; applied = keep_big_blocks(); "
            "print(json.dumps({'applied': applied, 'env': os.environ['GLIBC_TUNABLES']}))")
    theirs = {} if operators is None else {"GLIBC_TUNABLES": operators}
    return json.loads(_python(code, **old, **theirs))


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt: glibc's malloc")
def test_ours_are_set_in_the_process_and_for_the_ones_it_starts_and_the_operators_win() -> None:
    alone = _keep_in_a_process(None)
    assert alone == {"applied": OURS, "env": MALLOC_TUNABLES}
    # an operator's threshold stays theirs: glibc applied it at start, and ours is not set over it
    theirs = "glibc.malloc.arena_max=2:glibc.malloc.mmap_threshold=131072"
    beside = _keep_in_a_process(theirs)
    assert beside["applied"] == [t for t in OURS if t.startswith("glibc.malloc.trim_threshold")]
    assert beside["env"] == f"{theirs}:{beside['applied'][0]}"
    both = _keep_in_a_process("glibc.malloc.trim_threshold=1:glibc.malloc.mmap_threshold=2")
    assert both == {"applied": [], "env": "glibc.malloc.trim_threshold=1:glibc.malloc.mmap_threshold=2"}
    older = _keep_in_a_process(None, MALLOC_TRIM_THRESHOLD_="131072")  # glibc's older variable
    assert older == {"applied": OURS[:1], "env": OURS[0]}


def test_a_worker_says_at_start_that_it_keeps_a_steps_arrays(
        tmp_path: Path, pg_url: str, redis_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for inherited in ("GLIBC_TUNABLES", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        monkeypatch.delenv(inherited, raising=False)  # the worker's environment is the test's
    cluster = Cluster(tmp_path, pg_url, ADMIN_TOKEN, redis_url=redis_url)
    try:
        cluster.start_server()
        worker = cluster.start_worker(beat=False)
        assert f"phalanx worker: malloc keeps a step's arrays ({MALLOC_TUNABLES})" in worker.log()
    finally:
        cluster.stop()
