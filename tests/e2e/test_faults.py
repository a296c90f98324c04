"""Faults a deployment meets, with real processes: the job ends where the reference trainer
ends. Redis here is a private `redis-server` of the test's own, so it can be stopped (the
process, not a flush) and started again empty on the same port."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from tests.e2e.cluster import Cluster, reference_metrics, rel_diff
from tests.support.env import ADMIN_TOKEN
from tests.support.server import free_port
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow


class PrivateRedis:
    """A redis-server without persistence on a port of its own."""

    def __init__(self, root: Path) -> None:
        self.root, self.port = root, free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        log = (self.root / "redis.log").open("ab")
        self.process = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
             "--appendonly", "no", "--dir", str(self.root)], stdout=log, stderr=log)
        wait_for("the private Redis to answer", self.answers, timeout=30)

    def answers(self) -> bool:
        try:
            return bool(redis.Redis.from_url(self.url, socket_connect_timeout=1).ping())
        except redis.RedisError:
            return False

    def kill(self) -> None:
        if self.process is not None:
            self.process.kill()
            self.process.wait(timeout=10)


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path / "redis")
    server.start()
    yield server
    server.kill()


def test_redis_stopped_mid_job_and_started_empty_loses_nothing(
        private_redis: PrivateRedis, pg_url: str, tmp_path: Path) -> None:
    """Redis, the broker and the hot state, is killed for 20 s mid-job and comes back empty:
    the API answers, the worker reconnects, the job resumes from its last checkpoint and
    ends where the reference trainer ends."""
    cluster = Cluster(tmp_path, pg_url, ADMIN_TOKEN, redis_url=private_redis.url)
    try:
        cluster.start_server()
        cluster.start_worker()
        for i in range(3):
            cluster.start_agent(f"phone-{i}", {"PHALANX_AGENT_SLOWDOWN": "2"})
        spec = {"name": "faults", "model": {"arch": "cnn"}, "dataset": "digits",
                "global_batch_size": 256, "shards": 16, "epochs": 4, "seed": 1,
                "checkpoint_every": 5, "optimizer": {"lr": 0.1, "momentum": 0.9},
                "placement": {"min_devices": 1, "max_devices": 8}}
        job_id = cluster.submit(spec)
        cluster.wait_job(job_id, lambda j: j["step"] >= 7, "a step past the first checkpoint")
        private_redis.kill()
        time.sleep(20)  # the outage itself; nothing is asserted about time
        with cluster.client() as c:  # the control plane still answers what Postgres holds
            assert c.get(f"/v1/jobs/{job_id}").status_code == 200
        private_redis.start()
        job = cluster.wait_done(job_id, timeout=300)
        assert "StateRestored" in [e["reason"] for e in cluster.events(job_id)]
    finally:
        cluster.stop()
    ref = reference_metrics(spec, tmp_path / "reference")
    assert job["step"] == ref["steps"]
    assert rel_diff(job["metrics"]["train_loss"], ref["train_loss"]) < 1e-5, (job, ref)
