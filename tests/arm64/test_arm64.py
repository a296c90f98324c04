"""ARM64: the portable path gives x86's bytes on emulated ARM64 CPUs whose OpenBLAS kernels
differ, and an ARM64 agent trains through an x86 server to the x86 reference's hash.

The ARM64 userland is a Debian arm64 root run under qemu-user (`scripts/arm64.sh`: built on the
first run, a few minutes on a fresh machine, cached after), with the manylinux aarch64 numpy
wheel, running this repository's engine and agent. Nothing here is skipped: a machine that
cannot build or run the root fails these tests with the script's reason. qemu's timings say
nothing about a phone's speed; only bits are compared.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.agent import live, phone
from tests.e2e.cluster import reference_metrics
from tests.support.server import LiveServer
from tests.support.waiting import wait_for

REPO = Path(__file__).resolve().parents[2]
ARM64 = REPO / "scripts" / "arm64.sh"
# emulated CPUs whose OpenBLAS kernels differ (scripts/arm64.sh check lists each one's kernel)
CPUS = ("cortex-a53", "neoverse-n1", "max")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def arm64_root() -> None:
    """The root built (or checked) once per module; its failure is this module's failure."""
    out = subprocess.run(["bash", str(ARM64), "build"], capture_output=True, text=True,
                         timeout=1500)
    assert out.returncode == 0, f"scripts/arm64.sh build failed:\n{out.stderr[-4000:]}"


def in_arm64(cpu: str, *cmd: str, env: dict[str, str] | None = None,
             timeout: float = 900) -> subprocess.CompletedProcess[str]:
    extra = [arg for name, value in (env or {}).items() for arg in ("-e", f"{name}={value}")]
    return subprocess.run(["bash", str(ARM64), "run", "--cpu", cpu, *extra, "--",
                           *cmd], capture_output=True, text=True, timeout=timeout, cwd=REPO,
                          env={**os.environ, "PYTHONPATH": str(REPO)})


def digests(run: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout)


def host_digests(exactness: str) -> dict[str, Any]:
    return digests(subprocess.run(
        [sys.executable, "-m", "engine.compute_class", "--digests", "--exactness", exactness],
        capture_output=True, text=True, cwd=REPO, timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)}))


def test_portable_shards_and_steps_on_arm64_cpus_equal_x86(arm64_root: None) -> None:
    x86 = host_digests("portable")
    x86_class = host_digests("class")

    def on(cpu: str) -> dict[str, Any]:
        return digests(in_arm64(cpu, "python3", "-m", "engine.compute_class", "--digests",
                                "--exactness", "portable"))

    with ThreadPoolExecutor(len(CPUS)) as pool:
        arm = dict(zip(CPUS, pool.map(on, CPUS)))
    kernels = {cpu: r["compute_class"]["blas"]["kernel"] for cpu, r in arm.items()}
    print("\nOpenBLAS kernels:", kernels)
    assert {r["compute_class"]["machine"] for r in arm.values()} == {"aarch64"}
    assert len(set(kernels.values())) == len(CPUS), kernels  # three kernels really ran
    for cpu, r in arm.items():  # mlp, cnn, resnet18, mobilenet_v2; sgd, adamw, lars steps
        assert r["digests"] == x86["digests"], (cpu, r["digests"], x86["digests"])
    # the class path on ARM64 is another compute class: other bits, another fingerprint
    arm_class = digests(in_arm64("max", "python3", "-m", "engine.compute_class", "--digests",
                                 "--exactness", "class", "--models", "cnn,resnet18"))
    assert arm_class["digests"]["shard:cnn"] != x86_class["digests"]["shard:cnn"]
    assert arm_class["compute_class"]["fingerprint"] != x86_class["compute_class"]["fingerprint"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    yield from live.live_server(tmp_path_factory.mktemp("arm64-server"))


def job_spec(selector: dict[str, str], devices: int, shards: int) -> dict[str, Any]:
    return {"name": f"arm64-{devices}", "model": {"arch": "cnn"}, "dataset": "digits",
            "global_batch_size": 16 * shards, "shards": shards, "epochs": 1, "seed": 5,
            "exactness": "portable", "label_smoothing": 0.05,
            "optimizer": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.0001,
                          "warmup_epochs": 0.5, "schedule": "cosine"},
            "placement": {"min_devices": devices, "max_devices": devices,
                          "selector": selector},
            "verification": {"audit_rate": 0.0, "probation_steps": 0}}  # tests/e2e/test_liar.py


def run_job(server: LiveServer, spec: dict[str, Any],
            logs: list[Path]) -> tuple[dict[str, Any], set[str]]:
    """The finished job, and every device seen holding its shards while it ran."""
    with server.client() as c:
        created = c.post("/v1/jobs", json=spec)
        assert created.status_code == 201, created.text
        job_id = created.json()["id"]
    held: set[str] = set()

    def finished() -> dict[str, Any] | None:
        with server.client() as c:
            j = c.get(f"/v1/jobs/{job_id}").json()
        held.update(j.get("devices") or [])
        return j if j["state"] in ("Succeeded", "Failed", "Cancelled") else None

    done = wait_for(f"job {spec['name']} to finish", finished, timeout=900,
                    on_fail=lambda: "\n".join(p.read_text()[-3000:] for p in logs if p.exists())
                    + server.log()[-3000:])
    return done, held


def test_an_arm64_agent_trains_through_an_x86_server_to_the_x86_reference(
        arm64_root: None, server: LiveServer, tmp_path: Path) -> None:
    pair = uuid.uuid4().hex[:8]
    phones = []
    for name in ("x86", "arm"):
        root = phone.build_tree(tmp_path / f"{name}-sysfs")
        live.set_cpu_temp(root, 40.0)
        phones.append(live.enroll(server, tmp_path / name, root, f"pair={pair}"))
    x86, arm = phones
    arm_log = arm.log
    arm_log.parent.mkdir(parents=True, exist_ok=True)
    # the ARM64 phone: the repository's agent under qemu (cortex-a53: a phone's little core),
    # its compute worker a subprocess of the same emulated python
    with arm_log.open("ab") as fh:
        arm_proc = subprocess.Popen(
            ["bash", str(ARM64), "run", "--cpu", "cortex-a53",
             "-e", f"PHALANX_SYSFS_ROOT={arm.root}", "-e", "PYTHONUNBUFFERED=1", "--",
             "python3", "-m", "agent", "run", "--config", str(arm.config)],
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, stdout=fh,
            stderr=subprocess.STDOUT)
    x86.start()
    try:
        def reported(p: live.Phone) -> dict[str, Any] | None:
            d = live_device(server, p.device_id)  # the agent's first heartbeat is in
            return d if d["state"] == "Ready" and d["capabilities"].get("compute_class") else None

        for p in phones:
            wait_for(f"{p.device_id}'s agent to report", lambda p=p: reported(p), timeout=300,
                     on_fail=lambda: arm_log.read_text())
        facts = live_device(server, arm.device_id)["capabilities"]["compute_class"]
        assert facts["machine"] == "aarch64", facts  # what an operator sees of the phone
        # every shard on the ARM64 phone: each of its results is an ARM64 computation
        alone = job_spec({"phone": arm.label}, 1, 4)
        done, held = run_job(server, alone, [arm_log])
        assert done["state"] == "Succeeded", done
        assert held == {arm.device_id}
        ref = reference_metrics(alone, tmp_path / "ref-alone")
        assert done["metrics"]["params_sha256"] == ref["params_sha256"]
        # both phones in one job: shards computed on either, added up the same tree
        both = job_spec({"pair": pair}, 2, 8)
        done, held = run_job(server, both, [arm_log, x86.log])
        assert done["state"] == "Succeeded", done
        assert held == {x86.device_id, arm.device_id}
        ref = reference_metrics(both, tmp_path / "ref-both")
        assert done["metrics"]["params_sha256"] == ref["params_sha256"]
    finally:
        arm_proc.terminate()
        x86.stop()
        arm_proc.wait(timeout=60)
    assert "Traceback" not in arm_log.read_text()


def live_device(server: LiveServer, device_id: str) -> dict[str, Any]:
    with server.client() as c:
        return c.get(f"/v1/devices/{device_id}").json()
