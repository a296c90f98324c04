"""A real Prometheus scraping a real control plane (Postgres, Redis, `phalanx server`, a `phalanx
worker` with beat) while simulated phones running the real agent train: every PromQL expression
of every dashboard returns data, every alert rule evaluates, and the dashboards' SQL returns rows
for the phones and jobs that ran. One cluster, observed once, for all the tests here."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pytest
import yaml

from phalanx.sim.phone import PhoneOptions, PhoneRack, SimulatedPhone
from phalanx.sim.profiles import get_profile
from tests.deploy.tools import (
    DEPLOY,
    Prometheus,
    Query,
    fill_promql,
    fill_sql,
    queries,
    start_prometheus,
)
from tests.e2e.cluster import Cluster
from tests.support.databases import PostgresTemplate, flushed_redis, redis_test_url
from tests.support.env import ADMIN_TOKEN as ADMIN
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow


def spec(name: str, epochs: int) -> dict[str, Any]:
    return {"name": name, "model": {"arch": "mlp"}, "dataset": "digits", "global_batch_size": 128,
            "shards": 4, "epochs": epochs, "placement": {"min_devices": 1, "max_devices": 3},
            "verification": {"audit_rate": 0.0, "probation_steps": 0}}  # tests/e2e/test_liar.py


@dataclass
class Observed:
    prom: Prometheus
    pg_url: str
    finished_job: str
    running_job: str
    devices: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory,
             pg_template: PostgresTemplate) -> Iterator[Observed]:
    root = tmp_path_factory.mktemp("observed")
    pg_url = pg_template.clone()
    redis_url = redis_test_url()
    cluster = Cluster(root, pg_url, ADMIN, redis_url=redis_url)
    rack: PhoneRack | None = None
    prom: Prometheus | None = None
    with flushed_redis(redis_url):
        try:
            server = cluster.start_server()
            cluster.start_worker()
            prom = start_prometheus(server.url.removeprefix("http://"), root / "prometheus")
            sd855 = get_profile("galaxy-s10plus-sd855")
            phones = [SimulatedPhone(f"rack-{i}", sd855, root / f"phone-{i}",
                                     PhoneOptions(labels={"rack": "obs"}, seed=i, plugged=False)) for i in range(3)]
            with cluster.client() as admin:
                token = admin.post("/v1/enrollment-tokens", json={}).json()["token"]
            for phone in phones:
                phone.enroll(server.url, token)
            rack = PhoneRack(phones, period_s=0.25)
            rack.start()
            # 3 epochs: its validation accuracy (0.90) clears the gauge test's 0.5 (1 epoch: 0.46)
            finished = cluster.submit(spec("observed-short", epochs=3))
            cluster.wait_done(finished, timeout=180)
            # sliced: its phones fetch the weights a slice at a time (the data plane panel)
            running = cluster.submit({**spec("observed-long", epochs=500), "slices": 2})
            cluster.wait_job(running, lambda j: j["state"] == "Running" and j["step"] >= 3,
                             "the long job to run a few steps", timeout=120)
            # enough scrapes that every rate() window holds several samples of each series
            wait_for("Prometheus to hold 25 s of scrapes",
                     lambda: _scrape_span_s(prom) >= 25, timeout=90, every=1,
                     on_fail=prom.log)
            yield Observed(prom, pg_url, finished, running, [str(p.device_id) for p in phones])
        finally:
            if rack is not None:
                rack.stop()
            cluster.stop()
            if prom is not None:
                prom.stop()
            pg_template.drop_clone(pg_url)


def _scrape_span_s(prom: Prometheus) -> float:
    got = prom.query("time() - min_over_time(timestamp(up{job=\"phalanx-api\"})[5m:1s])")
    up = prom.query('up{job="phalanx-api"}')
    if not got or not up or up[0]["value"][1] != "1":
        return 0.0
    return float(got[0]["value"][1])


def _id(q: Query) -> str:
    return f"{q.dashboard}:{q.panel}:{q.ref}"


PROMQL = list(queries("prometheus"))
SQL = list(queries("sql"))
# panels of what a healthy cluster never does: here they must show nothing, and
# tests/e2e/test_liar.py shows them filled by a lying phone
HEALTHY_SHOWS_NONE = ("Quarantined phones",)


@pytest.mark.parametrize("query", PROMQL, ids=_id)
def test_every_dashboard_expression_returns_data(observed: Observed, query: Query) -> None:
    # the Job dashboard, pointed at a finished job (validation accuracy is computed on the final
    # weights) and at the running one for everything that a running job has
    jobs = [observed.finished_job]
    if query.dashboard == "job.json" and "val_accuracy" not in query.text:
        jobs.append(observed.running_job)
    for job_id in jobs:
        expr = fill_promql(query.text, {"job_id": job_id})
        result = observed.prom.query(expr)
        if query.panel in HEALTHY_SHOWS_NONE:
            assert result == [], f"{query.panel} in a healthy cluster: {result}"
            continue
        assert result, f"no data for {expr!r} (job {job_id})"
        values = [float(r["value"][1]) for r in result]
        # NaN is Prometheus's 0/0 for an idle series (a route not called in the window)
        assert any(v == v for v in values), f"only NaN from {expr!r}: {result}"


def test_the_job_gauges_tell_the_truth(observed: Observed) -> None:
    def one(expr: str) -> float:
        return float(observed.prom.query(expr)[0]["value"][1])

    done = f'{{job_id="{observed.finished_job}"}}'
    assert one(f"max(phalanx_job_progress_ratio{done})") == 1.0
    assert one(f"max(phalanx_job_step{done})") == one(f"max(phalanx_job_total_steps{done})")
    assert one(f"max(phalanx_job_val_accuracy{done})") > 0.5
    assert one(f"max(phalanx_job_energy_joules{done})") > 0
    assert one(f"max(phalanx_job_samples_per_second{done})") > 0
    assert one('max(phalanx_devices{state="Ready"})') == 3
    assert one("max(phalanx_device_enrollments_total)") == 3
    assert one('max(phalanx_jobs{state="Succeeded"})') == 1


# the one series that names a phone, for the overheating alert: bounded to one per sensor
NAMED = "phalanx_hottest_device_temperature_celsius"


def test_fleet_series_carry_no_device_id(observed: Observed) -> None:
    series = observed.prom.api("series", **{"match[]": '{__name__=~"phalanx_.+"}'})
    assert series
    for labels in series:
        assert not any(d in labels.values() for d in observed.devices), labels
        if labels["__name__"] == NAMED:
            assert set(labels) == {"__name__", "sensor", "device", "instance", "job"}, labels
            continue
        assert not set(labels) & {"device_id", "device"}, labels
    now = observed.prom.query(f"count by (sensor, instance) ({NAMED})")
    assert now and all(float(r["value"][1]) == 1 for r in now), now


def test_every_alert_rule_evaluates_on_the_live_series(observed: Observed) -> None:
    committed = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    names = {r["alert"] for g in committed["groups"] for r in g["rules"]}
    groups = observed.prom.api("rules")["groups"]
    loaded = {r["name"]: r for g in groups for r in g["rules"]}
    assert set(loaded) == names
    for name, rule in loaded.items():
        assert rule["health"] == "ok", f"{name}: {rule.get('lastError')}"
        assert rule["lastEvaluation"] and not rule["lastEvaluation"].startswith("0001"), name
    # a healthy cluster: the scheduler runs and nothing is failing or overheating
    firing = {a["labels"]["alertname"] for a in observed.prom.api("alerts")["alerts"]}
    assert not firing & {"PhalanxSchedulerLoopNotRunning", "PhalanxApplyStepFailing"}, firing


@pytest.mark.parametrize("query", SQL, ids=_id)
def test_every_sql_panel_returns_rows_for_what_ran(observed: Observed, query: Query) -> None:
    variables = {"device": observed.devices[0], "job_id": observed.finished_job}
    sql = fill_sql(query.text, variables)
    with psycopg.connect(observed.pg_url.replace("postgresql+psycopg://", "postgresql://")) as conn:
        rows = conn.execute(sql).fetchall()
    may_be_empty = ("Shards held by job", "Shards moved onto this phone")
    if query.panel in HEALTHY_SHOWS_NONE:
        assert rows == [], f"{query.panel} in a healthy cluster: {rows}"
    elif query.panel not in may_be_empty:
        assert rows, f"{query.panel}: no rows from {sql}"
