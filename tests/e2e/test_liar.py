"""A phone that lies, caught (issue 41; docs/scheduler.md, "Audits"): Postgres, Redis,
`phalanx server`, a `phalanx worker` and six phones running the real agent, one of them
through phalanx.sim.liar (its computed results corrupted before they are uploaded, from the
step after its probation and two more, honest but maybe unaudited). The job ends Succeeded on the reference trainer's weights bit for
bit, and the liar is quarantined within the steps the audit rate predicts."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import psycopg
import pytest

from scheduler.policy.audit import steps_to_catch
from tests.deploy.tools import queries
from tests.e2e.cluster import Cluster, reference_metrics
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow

RATE, PROBATION, LIES_FROM = 0.7, 2, 4  # honest (maybe unaudited) at steps 2 and 3, then lies
SPEC: dict[str, Any] = {
    "name": "liar", "model": {"arch": "cnn"}, "dataset": "digits", "global_batch_size": 256,
    "shards": 16, "epochs": 2, "seed": 0, "checkpoint_every": 2,
    "optimizer": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.0001, "warmup_epochs": 1},
    # six phones; five go on without the liar once it is quarantined
    "placement": {"min_devices": 5, "max_devices": 6},
    "verification": {"audit_rate": RATE, "probation_steps": PROBATION},
}


def test_a_job_on_six_phones_one_lying_ends_on_the_reference_and_the_liar_is_quarantined(
        cluster: Cluster, tmp_path: Path, pg_url: str) -> None:
    liar = cluster.start_agent("liar", runner=("phalanx.sim.liar", "--lie",
                                               f"flip:1:{LIES_FROM}"))
    phones = [liar, *(cluster.start_agent(f"phone-{i}") for i in range(5))]
    wait_for("six phones to report their compute class", lambda: all(
        cluster.device(p.device_id)["compute_class"] for p in phones), every=0.2)
    job_id = cluster.submit(SPEC)
    job = cluster.wait_done(job_id, timeout=180)
    ref = reference_metrics(SPEC, tmp_path / "reference")
    assert job["metrics"]["params_sha256"] == ref["params_sha256"], cluster.diagnostics()
    assert job["step"] == ref["steps"]
    events = cluster.events(job_id)
    caught = [e for e in events if e["reason"] == "ResultMismatch"]
    assert caught and {e["device_id"] for e in caught} == {liar.device_id}, events
    facts = caught[0]["data"]
    assert facts["loser"] == liar.device_id and facts["step"] >= LIES_FROM
    lied, told = (("auditor", "holder") if facts["auditor"] == liar.device_id
                  else ("holder", "auditor"))  # caught computing its own nodes, or auditing
    assert facts[f"{lied}_sha256"] != facts[f"{told}_sha256"] == facts["decider_sha256"]
    # it lies on every node it uploads from step LIES_FROM on (a node or two a step): caught
    # within the steps after which (1 - r)^(n T) < 0.001 for n = 1
    assert facts["step"] - LIES_FROM < steps_to_catch(RATE, 1, 0.999), facts
    device = cluster.device(liar.device_id)
    assert device["state"] == "Cordoned" and device["quarantine_reason"], device
    # Grafana's fleet dashboard lists it (its panel is empty in the healthy observed cluster
    # of tests/deploy/test_live_prometheus.py)
    panel = [q for q in queries("sql") if q.panel == "Quarantined phones"]
    assert panel
    with psycopg.connect(pg_url.replace("postgresql+psycopg://", "postgresql://")) as conn:
        listed = conn.execute(panel[0].text).fetchall()
    assert [(row[0], row[1], row[2]) for row in listed] == [
        ("liar", liar.device_id, "Cordoned")], listed
    with cluster.client() as http:
        metrics = http.get("/metrics").text
        quarantined = re.search(r'^phalanx_quarantines_total\{device="liar"\} (\S+)$',
                                metrics, re.M)
        assert quarantined and float(quarantined.group(1)) == 1.0, metrics
        lifted = http.post(f"/v1/devices/{liar.device_id}/uncordon")
        assert lifted.status_code == 200 and lifted.json()["quarantine_reason"] is None
        history = http.get(f"/v1/devices/{liar.device_id}/events",
                           params={"limit": 100}).json()["items"]
    assert [e["reason"] for e in history if e["reason"] in (
        "Quarantined", "QuarantineLifted")] == ["Quarantined", "QuarantineLifted"]
    rewound = [e for e in events if e["reason"] == "RewoundForAudit"]
    print(f"\nliar caught at step {facts['step']} (node {facts['node']}); "
          f"rewound: {[e['data'] for e in rewound]}")
