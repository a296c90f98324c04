"""Processes stop when told (docs/cli.md, "Stopping"): SIGTERM and SIGHUP stop `phalanx server`,
`phalanx demo`, `phalanx worker` and the agent as Ctrl-C does, and nothing is left behind. Each
test takes the whole tree of processes before the signal and finds none of it alive after.

The one bound timed is the documented one: the server ends within 3 s of the signal, a device
waiting in a work long poll (it answers "no work" at once, not at the graceful timeout)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import yaml

from hotstate.blobs import MemoryBlobStore
from hotstate.version import VersionWatch
from phalanx.cli.serving import STOP_S
from tests.support.databases import migrated_sqlite
from tests.support.env import ADMIN_TOKEN, without_settings
from tests.support.server import REPO_ROOT, LiveServer, start_server, stop_process

QUIT_S = 30.0  # how long a test waits for what has no documented bound (never met: a failure)


def tree(pid: int) -> list[psutil.Process]:
    """The process and everything it started, as they are now."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def survivors(processes: list[psutil.Process], timeout_s: float = QUIT_S) -> list[str]:
    """Those still running after `timeout_s` (a zombie has ended: only its entry is left)."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = []
        for proc in processes:
            try:
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    alive.append(proc)
            except psutil.NoSuchProcess:
                pass
        if not alive or time.monotonic() > deadline:
            return [f"{p.pid} {' '.join(p.cmdline()[:6])}" for p in alive if p.is_running()]
        time.sleep(0.1)


def exit_after_signal(proc: subprocess.Popen[Any], sig: int) -> float:
    """Send `sig`; the seconds until the process has ended."""
    sent = time.monotonic()
    proc.send_signal(sig)
    proc.wait(timeout=QUIT_S)
    return time.monotonic() - sent


def test_a_stopped_watch_answers_its_waiters_now_and_every_later_wait_at_once() -> None:
    """What the server does first at shutdown (hotstate.version.stop_waits calls `stop` on every
    watcher of the process; here only this one, the test's process has others)."""
    watch = VersionWatch(MemoryBlobStore(), interval_s=60.0)

    async def waits() -> tuple[bytes, bytes, bytes]:
        since = watch.snapshot()
        waiting = asyncio.create_task(watch.wait_change(since, timeout=30.0))
        await asyncio.sleep(0.05)
        stopper = threading.Thread(target=watch.stop)  # a signal's thread, not the loop's
        stopper.start()
        seen = await asyncio.wait_for(waiting, timeout=QUIT_S)
        later = await asyncio.wait_for(watch.wait_change(since, timeout=30.0), timeout=QUIT_S)
        stopper.join()
        return since, seen, later

    since, seen, later = asyncio.run(waits())
    assert seen == later == since and watch.stopping


class LongPoll:
    """A device's work long poll (what the agent sends between steps), in a thread, on a
    connection the server has already taken (a request sent on a connection still in the
    listening socket's queue would be refused at shutdown, not answered)."""

    def __init__(self, server: LiveServer) -> None:
        with server.client() as admin:
            enroll = admin.post("/v1/enrollment-tokens", json={}).json()["token"]
        device = httpx.post(f"{server.url}/v1/devices/register", timeout=30,
                            json={"enrollment_token": enroll, "name": "p"}).json()
        self.path = f"/v1/devices/{device['device_id']}/work?wait=30"
        self.client = httpx.Client(base_url=server.url, timeout=40, headers={
            "Authorization": f"Bearer {device['device_token']}"})
        self.answer: httpx.Response | Exception | None = None
        self.thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        try:
            self.answer = self.client.get(self.path)
        except httpx.HTTPError as exc:
            self.answer = exc

    def start(self) -> None:
        assert self.client.get(self.path.replace("wait=30", "wait=0")).status_code == 200
        self.thread.start()  # on the same connection
        time.sleep(1.0)  # the server waits in its long poll
        assert self.answer is None, self.answer

    def result(self) -> httpx.Response | Exception | None:
        self.thread.join(timeout=QUIT_S)
        self.client.close()
        return self.answer


@pytest.mark.parametrize("mode, sig", [("embedded", signal.SIGHUP), ("workers", signal.SIGTERM)])
def test_the_server_stops_within_3_s_of_the_signal_while_a_device_long_polls(
        mode: str, sig: int, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """Before: SIGTERM took 10.6 s (uvicorn's graceful timeout; the long poll got a 500),
    SIGHUP killed the server at once (the long poll's connection dropped, nothing flushed) and
    restarted --workers N's workers."""
    if mode == "embedded":
        server = start_server(database_url=migrated_sqlite(tmp_path / "p.sqlite"),
                              data_dir=tmp_path / "data", admin_token=ADMIN_TOKEN)
    else:
        server = start_server(database_url=request.getfixturevalue("pg_url"),
                              redis_url=request.getfixturevalue("redis_url"),
                              data_dir=tmp_path / "data", admin_token=ADMIN_TOKEN,
                              args=["--workers", "2"])
    try:
        processes = tree(server.process.pid)
        assert len(processes) == 1 if mode == "embedded" else len(processes) >= 3, processes
        poll = LongPoll(server)
        poll.start()
        took = exit_after_signal(server.process, sig)
        answer = poll.result()
        assert took <= STOP_S, (took, server.log()[-3000:])
        assert isinstance(answer, httpx.Response), answer
        assert (answer.status_code, answer.json()) == (200, {"assignment": None})
        assert survivors(processes) == []
    finally:
        server.stop(kill=True)


SHORT_JOB = {
    "name": "signals",
    "model": {"arch": "mlp", "hidden": 32},
    "dataset": "digits",
    "global_batch_size": 64,
    "shards": 4,
    "epochs": 50,  # longer than the test: it is stopped while training
    "seed": 0,
    "optimizer": {"lr": 0.05},
    "placement": {"min_devices": 1, "max_devices": 2, "selector": {"rack": "a"}},
}


def compute_workers(processes: list[psutil.Process]) -> list[psutil.Process]:
    found = []
    for proc in processes:
        try:
            if "agent.runtime.worker" in proc.cmdline():
                found.append(proc)
        except psutil.NoSuchProcess:
            pass
    return found


def test_sigterm_stops_the_demo_its_server_phones_and_their_compute_workers(
        tmp_path: Path) -> None:
    """`kill` of a running demo left its server, its agents and their compute workers running.
    On the way, SIGHUP of one phone's agent alone stops that agent and its compute worker."""
    spec = tmp_path / "job.yaml"
    spec.write_text(yaml.safe_dump(SHORT_JOB))
    env = without_settings()
    env.update(PYTHONUNBUFFERED="1", COLUMNS="160")
    demo = subprocess.Popen(
        [sys.executable, "-m", "phalanx.cli.main", "demo", "--phones", "2", "--no-faults",
         "--job", str(spec), "--data-dir", str(tmp_path / "demo")],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(demo.stdout or ()), daemon=True)
    reader.start()
    processes: list[psutil.Process] = []
    try:
        processes += training_tree(demo, output)
        agents = [p for p in processes if p.cmdline()[1:4] == ["-m", "agent", "run"]]
        assert len(agents) == 2, processes
        phone = tree(agents[0].pid)
        os.kill(agents[0].pid, signal.SIGHUP)  # the agent alone, not its process group
        assert survivors(phone) == []
        exit_after_signal(demo, signal.SIGTERM)
        assert survivors(processes) == []
        reader.join(timeout=10)
        assert "stopping the phones and the control plane" in "".join(output)
    finally:  # a failed test leaves nothing running either
        stop_process(demo, kill=True)
        for proc in processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()


def training_tree(demo: subprocess.Popen[str], output: list[str]) -> list[psutil.Process]:
    """The demo's processes once every phone computes (each agent has its compute worker)."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert demo.poll() is None, "".join(output)[-3000:]
        processes = tree(demo.pid)
        if len(compute_workers(processes)) >= 2 and re.search(r"submitted", "".join(output)):
            return processes
        time.sleep(0.2)
    pytest.fail("the phones never computed:\n" + "".join(output)[-3000:])


def test_sighup_stops_the_worker_instead_of_restarting_it(redis_url: str, tmp_path: Path
                                                         ) -> None:
    """Away from a terminal Celery answered SIGHUP by starting itself again in the same process:
    the worker never stopped."""
    env = without_settings()
    env.update(PHALANX_REDIS_URL=redis_url, PHALANX_DATA_DIR=str(tmp_path / "data"),
               PHALANX_DATABASE_URL=migrated_sqlite(tmp_path / "p.sqlite"), PYTHONUNBUFFERED="1")
    worker = subprocess.Popen([sys.executable, "-m", "phalanx.cli.main", "worker", "--beat"],
                              cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(worker.stdout or ()), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not any(" ready." in line for line in output):
            assert worker.poll() is None and time.monotonic() < deadline, "".join(output)[-3000:]
            time.sleep(0.1)
        processes = tree(worker.pid)
        exit_after_signal(worker, signal.SIGHUP)
        reader.join(timeout=10)
        assert worker.returncode == 0, "".join(output)[-3000:]
        assert not any("Restarting celery worker" in line for line in output)
        assert survivors(processes) == []
    finally:
        stop_process(worker, kill=True, group=True)
