"""Production as deployed, from what deploy/Dockerfile installs: the files its build stage copies
and a plain `pip install .` (no dev or test extras), run from outside the repository so nothing
of the source tree or of the test environment is imported.

The test environment's extras once hid a missing runtime dependency (kombu's Redis transport
needs `packaging`, brought by `celery[redis]`): the worker could not start and the server could
not enqueue, while every test passed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest
import yaml

from domain.store.db import libpq_url
from tests.e2e.cluster import Cluster, Install, reference_metrics, rel_diff
from tests.support.env import ADMIN_TOKEN as ADMIN
from tests.support.env import without_settings
from tests.support.server import REPO_ROOT, free_port, start_server
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow

DOCKERFILE = REPO_ROOT / "deploy" / "Dockerfile"


def dockerfile_sources() -> list[str]:
    """What the Dockerfile's build stage copies from the repository (`COPY src dst` lines)."""
    build_stage = DOCKERFILE.read_text().split("\nFROM ", 2)[1]
    sources: list[str] = []
    for line in build_stage.splitlines():
        if line.startswith("COPY ") and "--from" not in line:
            sources += line.split()[1:-1]
    return sources


@pytest.fixture(scope="session")
def plain_install(tmp_path_factory: pytest.TempPathFactory) -> Install:
    """A venv holding `pip install .` of the Dockerfile's sources, and a directory outside the
    repository to run it in."""
    root = tmp_path_factory.mktemp("plain-install")
    src, run = root / "src", root / "run"
    src.mkdir()
    run.mkdir()
    for name in dockerfile_sources():
        path = REPO_ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name,
                            ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(path, src / name)
    subprocess.run([sys.executable, "-m", "venv", str(root / "venv")], check=True, timeout=120)
    python = root / "venv" / "bin" / "python"
    pip = subprocess.run([str(python), "-m", "pip", "install", "--disable-pip-version-check",
                          "-q", str(src)], capture_output=True, text=True, timeout=900)
    assert pip.returncode == 0, f"pip install . failed:\n{pip.stderr[-4000:]}"
    return Install(python=str(python), cwd=run)


def test_the_dockerfile_copies_every_package_the_project_declares() -> None:
    include = re.search(r'include = \[([^\]]*)\]', (REPO_ROOT / "pyproject.toml").read_text())
    assert include is not None
    packages = {p.strip().strip('"').rstrip("*") for p in include.group(1).split(",")}
    assert packages <= set(dockerfile_sources()), (packages, dockerfile_sources())


CHECK_SCRIPT = textwrap.dedent("""
    import importlib, json, pkgutil, sys
    import phalanx
    from sqlalchemy import create_engine, text
    from domain.settings import Settings
    from scheduler.celery_app import broker_problem, configure

    where = phalanx.__file__
    failed = {}
    count = 0
    for top in ("api", "scheduler", "hotstate", "agent", "engine", "wire", "phalanx", "pictures"):
        package = importlib.import_module(top)
        for module in pkgutil.walk_packages(package.__path__, top + "."):
            if module.name.endswith("__main__"):
                continue
            count += 1
            try:
                importlib.import_module(module.name)
            except Exception as exc:
                failed[module.name] = repr(exc)
    # what production loads lazily: the broker's transport, the Postgres driver
    problem = broker_problem(configure(Settings(redis_url=sys.argv[1])))
    with create_engine(sys.argv[2]).connect() as conn:
        conn.execute(text("SELECT 1"))
    print(json.dumps({"where": where, "modules": count, "failed": failed,
                      "broker": problem and problem.detail}))
""")


def test_a_plain_install_loads_everything_production_loads(
        plain_install: Install, pg_url: str, redis_url: str) -> None:
    proc = subprocess.run([plain_install.python, "-c", CHECK_SCRIPT, redis_url, pg_url],
                          cwd=plain_install.cwd, env=plain_install.env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not report["where"].startswith(str(REPO_ROOT)), "imported the source tree, not the install"
    assert report["modules"] > 100 and report["failed"] == {}, report
    assert report["broker"] is None, report["broker"]
    check = subprocess.run([plain_install.python, "-m", "pip", "check"], capture_output=True,
                           text=True, timeout=120)
    assert check.returncode == 0, check.stdout


@pytest.fixture
def empty_pg_url(pg_template) -> Iterator[str]:  # noqa: ANN001 - the conftest fixture
    """An empty Postgres database: the schema is the deployment's own `phalanx db upgrade`."""
    name = f"phalanx_deploy_{uuid.uuid4().hex[:10]}"
    admin = pg_template.admin_url
    with psycopg.connect(libpq_url(admin), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = f"{admin.rpartition('/')[0]}/{name}"
    yield url
    with psycopg.connect(libpq_url(admin), autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


SPEC = {
    "name": "deployed", "model": {"arch": "cnn"}, "dataset": "digits",
    "global_batch_size": 256, "shards": 8, "epochs": 3, "seed": 3, "checkpoint_every": 4,
    "optimizer": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.0001, "warmup_epochs": 1,
                  "schedule": "cosine"},
    "placement": {"min_devices": 2, "max_devices": 2},
    "verification": {"audit_rate": 0.0, "probation_steps": 0},  # audits: tests/e2e/test_liar.py
}


def deployed_commands() -> dict[str, list[str]]:
    """The argv docker-compose.yml runs for each of Phalanx's own services."""
    services = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())["services"]
    return {name: services[name]["command"] for name in ("migrate", "api", "worker", "beat")}


def test_the_kubernetes_manifests_run_the_commands_compose_runs() -> None:
    commands = deployed_commands()
    for manifest, container, service in (("api.yaml", "migrate", "migrate"),
                                         ("api.yaml", "api", "api"),
                                         ("worker.yaml", "worker", "worker"),
                                         ("beat.yaml", "beat", "beat")):
        found = {}
        for doc in yaml.safe_load_all((REPO_ROOT / "deploy" / "k8s" / manifest).read_text()):
            pod = (doc or {}).get("spec", {}).get("template", {}).get("spec", {})
            for c in pod.get("initContainers", []) + pod.get("containers", []):
                found[c["name"]] = c["command"]
        assert found.get(container) == commands[service], (manifest, container, found)


def as_module(argv: list[str]) -> list[str]:
    """A console-script argv as `python -m` arguments, for the install's interpreter."""
    return {"phalanx": ["phalanx.cli.main"], "celery": ["celery"]}[argv[0]] + argv[1:]


def test_production_as_deployed_trains_to_the_reference(
        plain_install: Install, empty_pg_url: str, redis_url: str, tmp_path: Path) -> None:
    """docker-compose.yml's commands from a plain install: `phalanx db upgrade` on an empty
    database, two API replicas (each with its uvicorn workers and bulk port) and two workers on
    one Postgres and Redis, one beat, a phone enrolled on each replica, the job submitted on one
    replica and watched on the other, a worker SIGKILLed mid-job and started again: the job
    ends where the reference trainer ends."""
    deployed = deployed_commands()
    env = {**plain_install.env(), "PHALANX_DATABASE_URL": empty_pg_url}
    upgrade = subprocess.run([plain_install.python, "-m", *as_module(deployed["migrate"])],
                             cwd=plain_install.cwd, env=env, capture_output=True, text=True,
                             timeout=120)
    assert upgrade.returncode == 0 and "newest schema" in upgrade.stdout, upgrade.stderr[-3000:]

    cluster = Cluster(tmp_path, empty_pg_url, ADMIN, redis_url=redis_url, install=plain_install)
    try:
        # the deployment's own commands; only the address differs (two replicas on one host)
        api = deployed["api"]
        assert api[:2] == ["phalanx", "server"] and api[2::2] == [
            "--host", "--port", "--bulk-port", "--workers"], api
        first, second = (cluster.start_server(args=["--bulk-port", str(free_port()),
                                                    "--workers", api[9]])
                         for _ in range(2))
        for replica in (first, second):
            ready = httpx.get(f"{replica.url}/readyz", timeout=10)
            assert ready.status_code == 200, ready.text
        killed = cluster.start_worker(argv=as_module(deployed["worker"]))
        cluster.start_worker(argv=as_module(deployed["worker"]))
        cluster.start_worker(argv=as_module(deployed["beat"]), ready_line="beat: Starting")
        phones = [cluster.start_agent("phone-a", server=first),
                  cluster.start_agent("phone-b", server=second)]
        job_id = cluster.submit(SPEC)

        def watched(job: dict) -> bool:  # on the replica the job was not submitted to
            return job["state"] == "Running" and job["step"] >= 3

        with second.client() as c:
            wait_for("the job to run 3 steps, seen on the second replica",
                     lambda: watched(c.get(f"/v1/jobs/{job_id}").json()),
                     timeout=180, on_fail=cluster.diagnostics)
            running = c.get(f"/v1/jobs/{job_id}").json()
        assert sorted(running["devices"]) == sorted(p.device_id for p in phones), running

        killed.kill()
        cluster.workers.remove(killed)
        cluster.start_worker(argv=as_module(deployed["worker"]))

        with second.client() as c:
            job = wait_for("the job to finish, seen on the second replica",
                           lambda: (j := c.get(f"/v1/jobs/{job_id}").json())["state"]
                           in ("Succeeded", "Failed", "Cancelled") and j,
                           timeout=300, on_fail=cluster.diagnostics)
        assert job["state"] == "Succeeded", f"{job}\n{cluster.diagnostics()}"
    finally:
        cluster.stop()
    ref = reference_metrics(SPEC, tmp_path / "reference")
    assert job["step"] == ref["steps"]
    assert rel_diff(job["metrics"]["train_loss"], ref["train_loss"]) < 1e-5, (job, ref)


@pytest.fixture
def no_packaging(tmp_path: Path) -> dict[str, str]:
    """An environment where `packaging` cannot be imported, as in a plain `pip install celery
    redis`: a package of that name on PYTHONPATH that raises what the missing one raises."""
    shadow = tmp_path / "shadow" / "packaging"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'packaging'\", name='packaging')\n")
    return {"PYTHONPATH": f"{shadow.parent}{os.pathsep}{REPO_ROOT}"}


def test_a_worker_without_its_broker_transport_stops_with_one_line(
        no_packaging: dict[str, str], redis_url: str) -> None:
    env = without_settings()
    env.update(no_packaging, PHALANX_REDIS_URL=redis_url)
    proc = subprocess.run([sys.executable, "-m", "phalanx.cli.main", "worker"], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "packaging" in lines[0] and "celery[redis]" in lines[0], lines


def test_a_worker_with_no_broker_gives_up_after_its_wait_with_one_line() -> None:
    env = without_settings()
    env.update(PYTHONPATH=str(REPO_ROOT), PHALANX_REDIS_URL="redis://:secret@127.0.0.1:1/0")
    proc = subprocess.run([sys.executable, "-m", "phalanx.cli.main", "worker",
                           "--broker-wait", "1"], cwd=REPO_ROOT, env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "does not answer" in lines[0], lines
    assert "secret" not in lines[0]  # the URL's password is masked


def test_readyz_names_a_broker_transport_that_cannot_load(
        no_packaging: dict[str, str], sqlite_url: str, redis_url: str, tmp_path: Path) -> None:
    server = start_server(database_url=sqlite_url, data_dir=tmp_path / "data", admin_token=ADMIN,
                          redis_url=redis_url, extra_env=no_packaging)
    try:
        ready = httpx.get(f"{server.url}/readyz", timeout=10)
        healthy = httpx.get(f"{server.url}/healthz", timeout=10)
    finally:
        server.stop()
    assert healthy.status_code == 200  # the process lives: restarting it would not help
    assert ready.status_code == 503, ready.text
    assert "packaging" in ready.json()["checks"]["broker"]
