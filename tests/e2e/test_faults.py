"""Faults a deployment meets, with real processes: the job ends where the reference trainer
ends. Redis here is a private `redis-server` of the test's own, so it can be stopped (the
process, not a flush) and started again empty on the same port."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from domain.store.db import upgrade
from tests.e2e.cluster import Cluster, reference_metrics, rel_diff
from tests.support.env import ADMIN_TOKEN
from tests.support.redis_server import start_compose_redis
from tests.support.server import free_port
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow

SPEC = {"name": "faults", "model": {"arch": "cnn"}, "dataset": "digits",
        "global_batch_size": 256, "shards": 16, "epochs": 4, "seed": 1, "checkpoint_every": 5,
        "optimizer": {"lr": 0.1, "momentum": 0.9}, "placement": {"min_devices": 1, "max_devices": 8},
        "verification": {"audit_rate": 0.0, "probation_steps": 0}}  # audits: test_liar.py


def run_job(cluster: Cluster, until_step: int) -> str:
    """A server, a worker and three slowed phones training SPEC, until it reaches `until_step`."""
    cluster.start_server()
    cluster.start_worker()
    for i in range(3):
        cluster.start_agent(f"phone-{i}", {"PHALANX_AGENT_SLOWDOWN": "2"})
    job_id = cluster.submit(SPEC)
    cluster.wait_job(job_id, lambda j: j["step"] >= until_step, f"step {until_step}")
    return job_id


def assert_matches(job: dict, tmp_path: Path) -> None:
    ref = reference_metrics(SPEC, tmp_path / "reference")
    assert job["step"] == ref["steps"]
    assert rel_diff(job["metrics"]["train_loss"], ref["train_loss"]) < 1e-5, (job, ref)


class PrivateRedis:
    """A redis-server run as docker-compose.yml runs it (tests.support.redis_server), on a
    port of its own."""

    def __init__(self, root: Path) -> None:
        self.root, self.port = root, free_port()
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        with (self.root / "redis.log").open("ab") as log:
            self.process = start_compose_redis(self.port, self.root, log)
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
    the API answers meanwhile, workers reconnect (or, having exited, are started again as
    their supervisor would), the job resumes from its last checkpoint and ends where the
    reference trainer ends."""
    cluster = Cluster(tmp_path, pg_url, ADMIN_TOKEN, redis_url=private_redis.url)
    try:
        job_id = run_job(cluster, until_step=7)  # past the first checkpoint
        private_redis.kill()
        time.sleep(20)  # the outage itself; nothing is asserted about time
        with cluster.client() as c:  # the control plane still answers what Postgres holds
            assert c.get(f"/v1/jobs/{job_id}").status_code == 200
        private_redis.start()
        # what compose's `restart: unless-stopped` and Kubernetes do: a worker that exited is
        # started again. A worker that loses its broker mid-task exits ("Unrecoverable error":
        # kombu's Redis transport fails acking on the lost connection), so one may be gone
        def supervised_until_done() -> dict | None:
            for worker in [w for w in cluster.workers if w.process.poll() is not None]:
                cluster.workers.remove(worker)
                cluster.start_worker()
            job = cluster.job(job_id)
            return job if job["state"] in ("Succeeded", "Failed", "Cancelled") else None

        job = wait_for("the job to finish", supervised_until_done, timeout=300, every=0.5,
                       on_fail=cluster.diagnostics)
        assert job["state"] == "Succeeded", f"{job}\n{cluster.diagnostics()}"
        assert "StateRestored" in [e["reason"] for e in cluster.events(job_id)]
    finally:
        cluster.stop()
    assert_matches(job, tmp_path)


class PrivatePostgres:
    """A PostgreSQL cluster of the test's own (initdb as the postgres user when run as root),
    so it can be stopped as a crash stops it and started again."""

    def __init__(self) -> None:
        # the real bin directory: pg_ctl may be a symlink from one that lacks createdb
        self.bindir = Path(shutil.which("pg_ctl") or "pg_ctl").resolve().parent
        self.root = Path(tempfile.mkdtemp(prefix="phalanx-pg-", dir="/tmp"))
        self.root.chmod(0o755)
        self.data, self.port = self.root / "data", free_port()
        self.run: list[str] = []
        if os.geteuid() == 0:  # initdb refuses root
            shutil.chown(self.root, "postgres")
            self.run = ["runuser", "-u", "postgres", "--"]

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/test"

    def pg(self, tool: str, *args: str) -> None:
        subprocess.run([*self.run, str(self.bindir / tool), *args], check=True,
                       capture_output=True, timeout=120)

    def create(self) -> None:
        self.pg("initdb", "-D", str(self.data), "-U", "postgres", "--auth=trust")
        self.start()
        self.pg("createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", "test")

    def start(self) -> None:
        self.pg("pg_ctl", "-D", str(self.data), "-l", str(self.root / "pg.log"), "-w", "-o",
                f"-p {self.port} -k /tmp -c listen_addresses=127.0.0.1", "start")

    def crash(self) -> None:
        self.pg("pg_ctl", "-D", str(self.data), "-m", "immediate", "stop")

    def remove(self) -> None:
        subprocess.run([*self.run, str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m",
                        "immediate", "stop"], capture_output=True, timeout=60)
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def private_postgres() -> Iterator[PrivatePostgres]:
    server = PrivatePostgres()
    try:
        server.create()
        upgrade(server.url)
        yield server
    finally:
        server.remove()


def test_postgres_restarted_mid_job_answers_503_and_loses_nothing(
        private_postgres: PrivatePostgres, redis_url: str, tmp_path: Path) -> None:
    """Postgres crashes (immediate stop) mid-job with heartbeats and step commits in flight and
    starts again 5 s later: meanwhile the API answers 503 with Retry-After, never 500; then
    the job ends where the reference trainer ends."""
    cluster = Cluster(tmp_path, private_postgres.url, ADMIN_TOKEN, redis_url=redis_url)
    try:
        job_id = run_job(cluster, until_step=3)
        private_postgres.crash()
        seen: list[tuple[int, str | None]] = []
        with cluster.client() as c:
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:
                r = c.get(f"/v1/jobs/{job_id}")
                seen.append((r.status_code, r.headers.get("Retry-After")))
                time.sleep(0.2)
        private_postgres.start()
        job = cluster.wait_done(job_id, timeout=300)
    finally:
        cluster.stop()
    assert (503, "1") in seen and all(code in (200, 503) for code, _ in seen), seen
    assert_matches(job, tmp_path)


def test_a_replica_killed_while_phones_long_poll_it_behind_a_load_balancer(
        private_redis: PrivateRedis, pg_url: str, tmp_path: Path) -> None:
    """Two API replicas behind a load balancer (a TCP proxy spreading new connections over the
    replicas that accept them, as a Kubernetes Service does); phones know only the balancer.
    One replica is SIGKILLed mid-job, holding phones' long polls and the bodies of uploads it
    received: the phones move to the other replica by their own retry, the results whose
    bodies died with it are computed again, and the job ends where the reference ends."""
    from types import SimpleNamespace

    from tests.support.proxy import TcpProxy

    cluster = Cluster(tmp_path, pg_url, ADMIN_TOKEN, redis_url=private_redis.url)
    balancer = None
    try:
        doomed, survivor = cluster.start_server(), cluster.start_server()
        balancer = TcpProxy([("127.0.0.1", int(r.url.rsplit(":", 1)[1]))
                             for r in (doomed, survivor)])
        cluster.start_worker()
        front = SimpleNamespace(url=balancer.url)
        for i in range(4):
            cluster.start_agent(f"phone-{i}", {"PHALANX_AGENT_SLOWDOWN": "2"}, server=front)
        job_id = cluster.submit(SPEC)
        cluster.wait_job(job_id, lambda j: j["step"] >= 4, "step 4")
        doomed.stop(kill=True)
        cluster.replicas.remove(doomed)
        cluster.server = survivor
        job = cluster.wait_done(job_id, timeout=300)
    finally:
        cluster.stop()
        if balancer is not None:
            balancer.close()
    assert job["state"] == "Succeeded", job
    assert_matches(job, tmp_path)


def test_a_partition_between_the_worker_and_redis_heals_and_loses_nothing(
        private_redis: PrivateRedis, pg_url: str, tmp_path: Path) -> None:
    """The worker reaches Redis (broker and hot state) through a link that is cut for 10 s
    mid-job: every connection reset, new ones refused. The workers apply every step here, so
    the job waits for the link; once it heals, the worker reconnects (one that exited is
    started again, as its supervisor would) and the job ends where the reference ends."""
    from tests.support.proxy import TcpProxy

    link = TcpProxy([("127.0.0.1", private_redis.port)])
    cluster = Cluster(tmp_path, pg_url, ADMIN_TOKEN, redis_url=private_redis.url,
                      server_env={"PHALANX_APPLY_ON_REPLICA": "false"})
    worker_env = {"PHALANX_REDIS_URL": link.redis_url()}
    try:
        cluster.start_server()
        cluster.start_worker(worker_env)
        for i in range(3):
            cluster.start_agent(f"phone-{i}", {"PHALANX_AGENT_SLOWDOWN": "2"})
        job_id = cluster.submit(SPEC)
        cluster.wait_job(job_id, lambda j: j["step"] >= 3, "step 3")
        link.cut()
        time.sleep(10)  # the partition itself; nothing is asserted about time
        cut_at = cluster.job(job_id)["step"]
        link.heal()

        def supervised_until_done() -> dict | None:
            for worker in [w for w in cluster.workers if w.process.poll() is not None]:
                cluster.workers.remove(worker)
                cluster.start_worker(worker_env)
            job = cluster.job(job_id)
            return job if job["state"] in ("Succeeded", "Failed", "Cancelled") else None

        job = wait_for("the job to finish", supervised_until_done, timeout=300, every=0.5,
                       on_fail=cluster.diagnostics)
    finally:
        cluster.stop()
        link.close()
    assert job["state"] == "Succeeded", job
    assert cut_at < job["step"]  # steps went on after the partition
    assert_matches(job, tmp_path)
