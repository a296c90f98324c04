"""Distributed training end to end: Postgres, Redis, `phalanx server`, `phalanx worker`
processes and phones running the real agent. Every job must end where the single-process
reference trainer (`phalanx train --local`) ends: train_loss within 1e-5 relative."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from tests.e2e.cluster import Cluster, reference_metrics, rel_diff
from tests.support.env import ADMIN_TOKEN as ADMIN
from tests.support.server import self_signed_pair
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow

TOLERANCE = 1e-5


def digits_spec(epochs: int = 3, min_devices: int = 1, **extra: Any) -> dict[str, Any]:
    return {
        "name": "digits-cnn", "model": {"arch": "cnn"}, "dataset": "digits",
        "global_batch_size": 256, "shards": 16, "epochs": epochs, "seed": 0,
        "checkpoint_every": 5,
        "optimizer": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.0001, "warmup_epochs": 1,
                      "schedule": "cosine"},
        "placement": {"min_devices": min_devices, "max_devices": 8},
        # no audits unless a test asks (tests/e2e/test_liar.py): these count uploads and time
        # steps of phones that each compute only their own shards
        "verification": {"audit_rate": 0.0, "probation_steps": 0},
        **extra,
    }


_REFERENCE: dict[str, dict[str, Any]] = {}


def reference(spec: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    key = json.dumps({k: v for k, v in spec.items() if k != "placement"}, sort_keys=True)
    if key not in _REFERENCE:
        _REFERENCE[key] = reference_metrics(spec, tmp_path / "reference")
    return _REFERENCE[key]


def assert_matches_reference(job: dict[str, Any], spec: dict[str, Any], tmp_path: Path) -> None:
    ref = reference(spec, tmp_path)
    got = job["metrics"]["train_loss"]
    same = job["metrics"].get("params_sha256") == ref["params_sha256"]
    print(f"\ntrain_loss {got!r} vs reference {ref['train_loss']!r}: relative difference "
          f"{rel_diff(got, ref['train_loss']):.2e}; final weights bit-identical: {same}")
    assert rel_diff(got, ref["train_loss"]) < TOLERANCE, (got, ref)
    assert job["step"] == ref["steps"]
    assert job["metrics"]["val_accuracy"] == pytest.approx(ref["val_accuracy"], abs=0.01)


def reasons(c: Cluster, job_id: str) -> list[str]:
    return [e["reason"] for e in c.events(job_id)]


def slowdown_file(c: Cluster, name: str, factor: float) -> Path:
    path = c.root / f"slowdown-{name}"
    path.write_text(str(factor))
    return path


def test_four_agents_wait_for_the_gang_then_match_the_reference(cluster: Cluster, tmp_path: Path) -> None:
    for i in range(3):
        cluster.start_agent(f"phone-{i}")
    spec = digits_spec(min_devices=4)
    job_id = cluster.submit(spec)
    waiting = cluster.wait_job(job_id, lambda j: "min_devices 4" in (j.get("reason") or ""),
                               "the gang to wait for a fourth phone")
    assert waiting["state"] == "Pending" and waiting["step"] == 0
    cluster.start_agent("phone-3")
    job = cluster.wait_done(job_id)
    assert_matches_reference(job, spec, tmp_path)
    assert "Scheduled" in reasons(cluster, job_id)


def uploaded_results(c: Cluster) -> dict[str, float]:
    """`phalanx_uploaded_results_total` by kind (shard, partial), from the server's /metrics."""
    with c.client() as client:
        text = client.get("/metrics").text
    found = re.findall(r'^phalanx_uploaded_results_total\{kind="(\w+)"\} (\S+)$', text, re.M)
    return {"partial": 0.0, "shard": 0.0} | {k: float(v) for k, v in found}


def test_phones_holding_several_shards_pre_add_them_and_match_the_reference_bit_for_bit(
        cluster: Cluster, tmp_path: Path) -> None:
    """Issue 21 item 1: two phones hold 8 of the 16 shards each (aligned blocks) and upload one
    partial a step where they uploaded 8 results; the final weights are the reference
    trainer's, bit for bit (it adds the same pairs of the same tree)."""
    for i in range(2):
        cluster.start_agent(f"phone-{i}")
    spec = digits_spec(epochs=2, min_devices=2)
    job_id = cluster.submit(spec)
    job = cluster.wait_done(job_id)
    assert_matches_reference(job, spec, tmp_path)
    assert job["metrics"]["params_sha256"] == reference(spec, tmp_path)["params_sha256"]
    counted = uploaded_results(cluster)
    # a phone's 8 shards go up as one partial a step, however many requests computed them (the
    # worker holds what it pre-added until the node is filled): 2 uploads a step, not 16. The
    # first step's first request is one shard (the agent times it): without holding, that
    # step alone costs 6 more uploads; a straggler's backup (a loaded machine) may cost one
    assert counted["partial"] >= job["step"], counted
    assert counted["shard"] + counted["partial"] <= 2 * job["step"] + 3, counted


def test_an_agent_killed_mid_run_and_a_fifth_joining_change_nothing(cluster: Cluster, tmp_path: Path) -> None:
    slow = {"PHALANX_AGENT_SLOWDOWN": "4"}  # steps long enough to kill and join mid-run
    agents = [cluster.start_agent(f"phone-{i}", slow) for i in range(4)]
    spec = digits_spec(epochs=4, min_devices=2)
    job_id = cluster.submit(spec)
    cluster.wait_job(job_id, lambda j: j["step"] >= 3, "step 3")
    victim = agents[0]
    victim.kill()
    cluster.start_agent("phone-4", slow)
    cluster.wait_job(job_id, lambda j: "ShardsMoved" in reasons(cluster, job_id)
                     or j["state"] == "Succeeded", "the dead phone's shards to move")
    job = cluster.wait_done(job_id, timeout=240)
    assert_matches_reference(job, spec, tmp_path)
    events = cluster.events(job_id)
    moved = [e for e in events if e["reason"] == "ShardsMoved"]
    assert any(victim.device_id in e["message"] for e in moved), moved
    assert "DeviceJoined" in [e["reason"] for e in events], [e["reason"] for e in events]


def test_a_stragglers_shards_are_recomputed_elsewhere(
        tmp_path: Path, pg_url: str, redis_url: str) -> None:
    cluster = Cluster(tmp_path, pg_url, ADMIN, redis_url=redis_url,
                      server_env={"PHALANX_SCHED_STRAGGLER_FLOOR_S": "0.5"})
    try:
        cluster.start_server()
        cluster.start_worker()
        straggle(cluster, tmp_path)
    finally:
        cluster.stop()


def straggle(cluster: Cluster, tmp_path: Path) -> None:
    knob = slowdown_file(cluster, "straggler", 1.0)
    cluster.start_agent("straggler", {"PHALANX_AGENT_SLOWDOWN_FILE": str(knob)})
    for i in range(3):
        cluster.start_agent(f"phone-{i}")
    spec = digits_spec(epochs=2, min_devices=4)
    job_id = cluster.submit(spec)
    cluster.wait_job(job_id, lambda j: j["step"] >= 2, "step 2")
    knob.write_text("200")  # after profiling: the phone now looks fast but is very slow
    job = cluster.wait_done(job_id, timeout=240)
    assert_matches_reference(job, spec, tmp_path)
    late = [e for e in cluster.events(job_id) if e["reason"] == "BackupAssigned"
            and e["data"].get("step", 0) >= 2]
    assert late, reasons(cluster, job_id)


def test_a_worker_killed_between_state_write_and_commit_loses_nothing(
        tmp_path: Path, pg_url: str, redis_url: str) -> None:
    # the workers apply every step here (a replica applies those it completes by default)
    c = Cluster(tmp_path, pg_url, ADMIN, redis_url=redis_url,
                server_env={"PHALANX_APPLY_ON_REPLICA": "false"})
    try:
        c.start_server()
        first = c.start_worker({"PHALANX_SCHED_APPLY_PAUSE_S": "2.0"})
        for i in range(4):
            c.start_agent(f"phone-{i}")
        spec = digits_spec(epochs=3)
        job_id = c.submit(spec)
        r = redis.Redis.from_url(redis_url)
        c.wait_job(job_id, lambda j: j["step"] >= 3, "step 3")

        def mid_step() -> int | None:
            step = c.job(job_id)["step"]
            # state t+1 written (under the applier's nonce), not yet named by a commit
            return step if r.keys(f"job:{job_id}:state:{step + 1}:*") else None

        crashed_at = wait_for("apply_step to be inside its crash window", mid_step, every=0.05)
        first.kill()
        assert c.job(job_id)["step"] == crashed_at  # state t+1 written, step t+1 not committed
        c.start_worker()
        job = c.wait_done(job_id)
        assert_matches_reference(job, spec, tmp_path)
        with c.client() as http:
            curve = http.get(f"/v1/jobs/{job_id}/metrics", params={"limit": 1000}).json()
        items = curve["items"] if isinstance(curve, dict) and "items" in curve else curve
        steps = [row["step"] for row in items]
        assert steps == sorted(set(steps)) and len(steps) == job["total_steps"]
    finally:
        c.stop()


def test_redis_losing_every_key_resumes_from_the_last_checkpoint(cluster: Cluster, tmp_path: Path) -> None:
    for i in range(4):
        cluster.start_agent(f"phone-{i}", {"PHALANX_AGENT_SLOWDOWN": "3"})
    spec = digits_spec(epochs=4)
    job_id = cluster.submit(spec)
    at = cluster.wait_job(job_id, lambda j: j["step"] >= 7, "a step past the first checkpoint")
    assert at["state"] == "Running", at
    redis.Redis.from_url(cluster.redis_url).flushdb()
    job = cluster.wait_done(job_id, timeout=240)
    assert_matches_reference(job, spec, tmp_path)
    restored = [e for e in cluster.events(job_id) if e["reason"] == "StateRestored"]
    assert restored, reasons(cluster, job_id)
    resumed = restored[0]["data"]["resumed_step"]
    assert resumed % 5 == 0 and 5 <= resumed <= restored[0]["data"]["lost_step"]


def test_cancel_releases_the_devices_for_the_next_job(cluster: Cluster, tmp_path: Path) -> None:
    agents = [cluster.start_agent(f"phone-{i}") for i in range(4)]
    job_id = cluster.submit(digits_spec(epochs=200, min_devices=4))
    cluster.wait_job(job_id, lambda j: j["state"] == "Running" and len(j["devices"]) == 4,
                     "the job to run on 4 phones")
    with cluster.client() as http:
        assert http.post(f"/v1/jobs/{job_id}/cancel").status_code == 200
    cluster.wait_job(job_id, lambda j: j["state"] == "Cancelled" and not j["devices"],
                     "the cancelled job to let its phones go")
    second = cluster.submit(digits_spec(epochs=200, min_devices=4, name="second"))
    placed = cluster.wait_job(second, lambda j: j["state"] == "Running" and len(j["devices"]) == 4,
                              "the next job to get the same phones")
    assert sorted(placed["devices"]) == sorted(a.device_id for a in agents)


def test_embedded_mode_trains_to_the_reference_without_redis_over_tls(
        tmp_path: Path, sqlite_url: str) -> None:
    """`phalanx server` alone: SQLite, in-memory broker and blob store, worker and beat threads;
    https on the API port and the bulk port with a lab's self-signed certificate."""
    c = Cluster(tmp_path, sqlite_url, ADMIN, tls=self_signed_pair(tmp_path))
    try:
        server = c.start_server()
        plain = server.url.replace("https://", "http://")
        with pytest.raises(httpx.HTTPError):  # no plain http beside https
            httpx.get(f"{plain}/healthz", timeout=5)
        unchecked = subprocess.run(  # an agent that does not know the lab's CA refuses it
            [sys.executable, "-m", "agent", "enroll", "--server", server.url, "--token",
             c.enrollment_token(), "--config", str(tmp_path / "unchecked.json")],
            capture_output=True, text=True, timeout=60, env=c.install.env())
        assert unchecked.returncode == 1 and "CERTIFICATE_VERIFY_FAILED" in unchecked.stderr
        agents = [c.start_agent(f"phone-{i}") for i in range(3)]
        spec = digits_spec(epochs=3, min_devices=3)
        job_id = c.submit(spec)
        token = json.loads(agents[0].config.read_text())["device_token"]
        with server.client(token) as phone:  # weights and uploads go to the bulk port, on TLS
            # a poll may end empty (the poll's cap, or between steps on a loaded machine)
            assignment = wait_for("an assignment for phone 0", lambda: phone.get(
                f"/v1/devices/{agents[0].device_id}/work",
                params={"wait": 10}).json()["assignment"], timeout=90)
        assert assignment["bulk_url"].startswith("https://127.0.0.1:")
        job = c.wait_done(job_id)
        assert_matches_reference(job, spec, tmp_path)
        assert not [a.name for a in agents if "bulk port" in a.log()]  # never left it
        cli_env = {**c.install.env(), "PHALANX_CONFIG": str(tmp_path / "cli.json")}
        cli = [sys.executable, "-m", "phalanx.cli.main"]
        subprocess.run([*cli, "login", "--server", server.url, "--token", ADMIN, "--ca-file",
                        str(server.ca_file)], env=cli_env, check=True, capture_output=True,
                       timeout=60)
        listed = subprocess.run([*cli, "jobs", "ls", "-o", "json"], env=cli_env, check=True,
                                capture_output=True, text=True, timeout=60)
        assert [j["id"] for j in json.loads(listed.stdout)] == [job_id]
    finally:
        c.stop()


def test_an_api_restart_mid_job_loses_nothing(cluster: Cluster, tmp_path: Path) -> None:
    for i in range(3):
        cluster.start_agent(f"phone-{i}", {"PHALANX_AGENT_SLOWDOWN": "3"})
    spec = digits_spec(epochs=3)
    job_id = cluster.submit(spec)
    cluster.wait_job(job_id, lambda j: j["step"] >= 3, "step 3")
    cluster.restart_server()
    job = cluster.wait_done(job_id, timeout=240)
    assert_matches_reference(job, spec, tmp_path)


def test_a_sliced_job_is_applied_across_the_workers_and_matches_the_reference_bit_for_bit(
        cluster: Cluster, tmp_path: Path) -> None:
    """Issue 21 item 2: the vector in 4 slices (engine.slices); each step's slices are applied
    by separate tasks (the replica that completes the step takes one, the two worker processes
    the others) and the step commits once all are stored: the final weights are still the
    reference trainer's, bit for bit."""
    cluster.start_worker(beat=False)
    for i in range(2):
        cluster.start_agent(f"phone-{i}")
    spec = digits_spec(epochs=2, min_devices=2, slices=4)
    job_id = cluster.submit(spec)
    job = cluster.wait_done(job_id)
    assert_matches_reference(job, spec, tmp_path)
    assert job["metrics"]["params_sha256"] == reference(spec, tmp_path)["params_sha256"]
    applied_by = [w.log().count("scheduler.apply_slice") for w in cluster.workers]
    assert all(n > 0 for n in applied_by), applied_by  # both workers applied slices
    # every slice read its ranges of the uploads from the replica: none was lost and redone
    assert not [w for w in cluster.workers if "replanned" in w.log()]
    # the phones fetched each slice as its own message, many of them ahead of their step's
    # commit (while the other slices were applied: issue 21 item 4)
    with cluster.client() as client:
        text = client.get("/metrics").text
    served = {k: float(v) for k, v in re.findall(
        r'^phalanx_weights_slices_served_total\{when="(\w+)"\} (\S+)$', text, re.M)}
    assert served.get("ahead", 0) > 0, served
    assert sum(served.values()) >= 2 * 4 * job["step"], served  # 2 phones x 4 slices a step


def test_a_worker_killed_mid_slice_loses_nothing_and_the_slice_is_applied_again(
        tmp_path: Path, pg_url: str, redis_url: str) -> None:
    """A sliced job (4 slices) on two workers; the one that pauses inside each slice it
    applies (its slice stored, not yet marked done) is SIGKILLed there. Its slice is applied
    again (the step's claim expires, reconcile sends the slices not done) and the job ends on
    the reference's weights, one row of metrics a step."""
    c = Cluster(tmp_path, pg_url, ADMIN, redis_url=redis_url,
                server_env={"PHALANX_APPLY_ON_REPLICA": "false",
                            "PHALANX_SCHED_APPLY_CLAIM_TTL_S": "3"})
    try:
        c.start_server()
        doomed = c.start_worker({"PHALANX_SCHED_APPLY_PAUSE_S": "3.0"}, beat=False)
        c.start_worker()  # the beat (reconcile) lives here
        for i in range(2):
            c.start_agent(f"phone-{i}")
        spec = digits_spec(epochs=2, min_devices=2, slices=4)
        job_id = c.submit(spec)
        r = redis.Redis.from_url(redis_url)
        c.wait_job(job_id, lambda j: j["step"] >= 2, "step 2")

        def pending(step: int) -> bool:
            stored = r.keys(f"job:{job_id}:state:{step + 1}:*:s*")
            done = r.keys(f"job:{job_id}:slices:{step}:done:*")
            return len(stored) > len(done)

        def slice_in_window() -> int | None:
            step = c.job(job_id)["step"]
            if not pending(step):
                return None
            # the doomed worker holds its window 3 s; the other worker's lasts milliseconds, and
            # catching that one (a loaded machine: seen once in a full run) is no stuck step
            time.sleep(0.5)
            return step if c.job(job_id)["step"] == step and pending(step) else None

        stuck_at = wait_for("a slice stored and not yet marked done", slice_in_window, every=0.05)
        doomed.kill()
        assert c.job(job_id)["step"] == stuck_at  # that step cannot commit without the slice
        job = c.wait_done(job_id)
        assert_matches_reference(job, spec, tmp_path)
        assert job["metrics"]["params_sha256"] == reference(spec, tmp_path)["params_sha256"]
        with c.client() as http:
            rows = http.get(f"/v1/jobs/{job_id}/metrics", params={"limit": 1000}).json()["items"]
        steps = [row["step"] for row in rows]
        assert steps == sorted(set(steps)) and len(steps) == job["total_steps"]
    finally:
        c.stop()


def test_a_sliced_job_in_embedded_mode_matches_the_reference_bit_for_bit(
        tmp_path: Path, sqlite_url: str) -> None:
    """`phalanx server` alone (in-process worker threads and memory broker): a job in 3 slices
    is applied by the server's own workers, and two real agents fetch its slices."""
    c = Cluster(tmp_path, sqlite_url, ADMIN)
    try:
        c.start_server()
        for i in range(2):
            c.start_agent(f"phone-{i}")
        spec = digits_spec(epochs=2, min_devices=2, slices=3)
        job = c.wait_done(c.submit(spec))
        assert_matches_reference(job, spec, tmp_path)
        assert job["metrics"]["params_sha256"] == reference(spec, tmp_path)["params_sha256"]
    finally:
        c.stop()
