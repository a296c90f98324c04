"""The Redis that docker-compose.yml runs, started here with the same command and environment:
every step writes a job's state afresh under a new name and drops the last one, so what that
Redis does with those bytes is on every step's path (docs/deploy.md, docs/benchmarks.md)."""

from __future__ import annotations

import resource
import time
from pathlib import Path

import numpy as np
import pytest
import redis

from hotstate import keys
from hotstate.blobs import RedisBlobStore
from tests.support.redis_server import compose_redis, start_compose_redis, stop
from tests.support.server import free_port

STATE_BYTES = 25_735_000  # mobilenet_v1's weights + SGD momentum, as a step stores them


def minor_faults(pid: int) -> int:
    """Pages the kernel had to map afresh for the process (field 10 of /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[7])


@pytest.fixture
def compose_redis_server(tmp_path: Path):
    port = free_port()
    process = start_compose_redis(port, tmp_path)
    client = redis.Redis(port=port)
    deadline = time.monotonic() + 20
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline or process.poll() is not None:
                stop(process)
                pytest.fail(f"the compose Redis command did not start: {compose_redis()[0]}")
            time.sleep(0.05)
    try:
        # the port was free when chosen: the Redis answering must be the one started here
        assert client.info("server")["process_id"] == process.pid, "another Redis took the port"
        yield process, f"redis://127.0.0.1:{port}/0", client
    finally:
        stop(process)


def test_the_compose_redis_keeps_a_steps_freed_state_for_the_next_and_writes_nothing_to_disk(
        compose_redis_server, tmp_path: Path) -> None:
    process, url, client = compose_redis_server
    allocator = client.info("memory")["mem_allocator"]
    if not allocator.startswith("jemalloc"):
        pytest.skip(f"this machine's redis-server allocates with {allocator}; the compose "
                    "setting is for jemalloc, which the redis:7 image uses")
    store = RedisBlobStore(url)
    state = np.random.default_rng(0).bytes(STATE_BYTES)
    previous, before = None, 0
    for step in range(12):  # as apply_step stores state t + 1, then drops state t
        if step == 4:
            before = minor_faults(process.pid)
        key = keys.state("job-1", step, keys.new_nonce())
        store.set(key, state)
        if previous is not None:
            store.delete(previous)
        previous = key
    pages = 8 * STATE_BYTES / resource.getpagesize()
    faulted = (minor_faults(process.pid) - before) / pages
    # the default decay hands most of each freed state back to the kernel (35-70% of a
    # state's pages faulted in again every step, measured): Redis's CPU a step doubled. With
    # the compose setting ~0 alone, up to 6% beside a loaded suite (its buffers for the parts
    # read in more pieces): the bound sits between the two
    assert faulted < 0.15, f"{faulted:.0%} of each state's pages were faulted in afresh"
    stop(process)
    assert process.returncode == 0, "Redis did not shut down cleanly"
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "Redis wrote the states to disk"
