"""`/metrics`: fleet gauges from the store, route templates (never raw paths or device ids),
and request counters that add up across several uvicorn worker processes."""

from __future__ import annotations

import datetime as dt
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import delete, insert

from domain.store.energy import integrate_power
from domain.store.events import event_row
from domain.store.models import Device, Event, Job, ShardAssignment, StepMetric, TelemetrySample
from roots.api import create_app
from tests.api.conftest import make_settings, sample
from tests.support.env import ADMIN_TOKEN as ADMIN
from tests.support.server import start_server
from wire.buffers import BUFFERS, POOLED_MIN_BYTES, new_buffer


def scrape(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict, metric: str, **labels: str) -> float:
    return samples[(metric, tuple(sorted(labels.items())))]


def total(samples: dict, metric: str, **labels: str) -> float:
    return sum(v for (n, ls), v in samples.items()
               if n == metric and labels.items() <= dict(ls).items())


def test_fleet_gauges_count_devices_by_state_and_bucket_their_telemetry(api) -> None:
    hot, cool, gone = api.register("hot"), api.register("cool"), api.register("gone")
    api.heartbeat(hot, {"telemetry": [sample(1.0, cpu_temp_c=62.0, battery_temp_c=41.0,
                                             power_w=4.5, throttled=True)]})
    api.heartbeat(cool, {"telemetry": [sample(1.0, cpu_temp_c=33.0, battery_temp_c=29.0,
                                              power_w=1.5, battery_pct=55.0)],
                         "pause": {"reason": "busy", "detail": "screen on"}})
    api.post(f"/v1/devices/{gone['device_id']}/cordon")
    samples = scrape(api.client.get("/metrics").text)
    assert value(samples, "phalanx_devices", state="Ready") == 2
    assert value(samples, "phalanx_devices", state="Cordoned") == 1
    assert value(samples, "phalanx_devices", state="NotReady") == 0
    assert value(samples, "phalanx_devices_registered") == 3
    assert value(samples, "phalanx_devices_throttled") == 1
    assert value(samples, "phalanx_devices_paused", reason="busy") == 1
    assert value(samples, "phalanx_fleet_power_total_watts") == 6.0
    assert value(samples, "phalanx_fleet_max_temperature_celsius", sensor="cpu") == 62.0
    # the alert's bounded series names the phone: one series per sensor, never one per device
    assert value(samples, "phalanx_hottest_device_temperature_celsius", sensor="cpu",
                 device="hot") == 62.0
    assert value(samples, "phalanx_hottest_device_temperature_celsius", sensor="battery",
                 device="hot") == 41.0
    assert sum(1 for (n, _) in samples if n == "phalanx_hottest_device_temperature_celsius") == 2
    # histogram snapshot: one phone at <= 35 C, both at <= 70 C
    assert value(samples, "phalanx_fleet_cpu_temperature_celsius_bucket", le="35.0") == 1
    assert value(samples, "phalanx_fleet_cpu_temperature_celsius_bucket", le="70.0") == 2
    assert value(samples, "phalanx_device_enrollments_total") == 3
    for (_, labels) in samples:
        names = {k for k, _ in labels}
        assert "device_id" not in names
        assert not {hot["device_id"], cool["device_id"]} & {v for _, v in labels}


def test_requests_are_counted_by_route_template_not_by_path(api) -> None:
    device = api.register()
    for _ in range(3):
        api.get(f"/v1/devices/{device['device_id']}")
    api.get("/v1/devices/dev-that-does-not-exist")
    api.client.get("/no/such/path/at/all")
    samples = scrape(api.client.get("/metrics").text)
    route = "/v1/devices/{device_id}"
    assert value(samples, "phalanx_http_requests_total", method="GET", route=route,
                 status="200") >= 3
    assert value(samples, "phalanx_http_requests_total", method="GET", route=route,
                 status="404") >= 1
    assert total(samples, "phalanx_http_requests_total", route="unmatched") >= 1
    assert value(samples, "phalanx_http_request_duration_seconds_count", method="GET",
                 route=route) >= 4
    paths = {v for (_, labels) in samples for k, v in labels if k == "route"}
    assert not any(device["device_id"] in p or "no/such" in p for p in paths)


def test_a_job_gets_progress_gauges_by_job_id(api) -> None:
    spec = {"name": "m", "model": {"arch": "mlp"}, "dataset": "digits", "global_batch_size": 64,
            "shards": 4, "epochs": 2}
    job = api.post("/v1/jobs", json=spec).json()
    samples = scrape(api.client.get("/metrics").text)
    assert value(samples, "phalanx_jobs", state="Pending") == 1
    assert value(samples, "phalanx_job_info", job_id=job["id"], name="m", state="Pending") == 1
    assert value(samples, "phalanx_job_step", job_id=job["id"]) == 0
    assert value(samples, "phalanx_job_total_steps", job_id=job["id"]) == job["total_steps"] > 0


def test_energy_integrates_power_per_device_and_skips_long_gaps() -> None:
    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)
    at = [t0 + dt.timedelta(seconds=s) for s in (0, 10, 20, 200)]
    samples = [("a", at[0], 2.0), ("b", at[0], 1.0), ("a", at[1], 4.0), ("b", at[1], 1.0),
               ("a", at[2], None), ("a", at[3], 4.0)]  # 180 s gap: the phone was away
    assert integrate_power(samples) == 10 * (2 + 4) / 2 + 10 * 1.0


def test_energy_counts_only_the_seconds_inside_each_phones_window() -> None:
    t0 = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc)

    def at(s: float) -> dt.datetime:
        return t0 + dt.timedelta(seconds=s)

    # power rises 2 W -> 6 W over 10 s; a job that ran from 2.5 s to 7.5 s, between two reports
    samples = [("a", at(0), 2.0), ("a", at(10), 6.0), ("b", at(0), 5.0), ("b", at(10), 5.0)]
    windows = {"a": (at(2.5), at(7.5)), "b": (at(8), at(30))}
    assert integrate_power(samples, windows) == 5 * (3 + 5) / 2 + 2 * 5.0
    assert integrate_power(samples, {"a": (at(12), at(20))}) == 0.0  # no phone, no joules


def test_a_finished_jobs_energy_takes_in_the_samples_that_arrive_after_its_end(api) -> None:
    """The phones' last samples of a job reach the server with their next heartbeat, after the
    job has ended: a scrape in between must not freeze the gauge at what it had seen."""
    phone = api.register()
    job = api.post("/v1/jobs", json={"name": "short", "model": {"arch": "mlp"},
                                      "dataset": "digits", "global_batch_size": 64,
                                      "shards": 4, "epochs": 1}).json()
    began = api.clock.now - dt.timedelta(seconds=20)
    ended = began + dt.timedelta(seconds=4)  # shorter than the phone's reporting period
    with api.app.state.session_factory() as session, session.begin():
        row = session.get(Job, job["id"])
        row.state, row.started_at, row.finished_at = "Succeeded", began, ended
        session.execute(insert(Event.__table__), [event_row(
            "Scheduled", "placed", now=began, job_id=job["id"], device_id=phone["device_id"])])

    def joules() -> float:
        return value(scrape(api.client.get("/metrics").text), "phalanx_job_energy_joules",
                     job_id=job["id"])

    before = began - dt.timedelta(seconds=3)
    assert api.heartbeat(phone, {"telemetry": [sample(before.timestamp(), power_w=3.0)]}).is_success
    assert joules() == 0.0  # nothing reported past the end yet
    after = ended + dt.timedelta(seconds=3)
    assert api.heartbeat(phone, {"telemetry": [sample(after.timestamp(), power_w=3.0)]}).is_success
    assert joules() == 4 * 3.0




def test_a_charging_phones_battery_power_is_not_counted_as_what_it_drew(api) -> None:
    """While a phone charges, its battery's power is what flows in (the charger supplies the
    phone): the job's energy counts only the stretches the phone ran on its battery."""
    phone = api.register()
    job = api.post("/v1/jobs", json={"name": "plugged", "model": {"arch": "mlp"},
                                      "dataset": "digits", "global_batch_size": 64,
                                      "shards": 4, "epochs": 1}).json()
    began = api.clock.now - dt.timedelta(seconds=40)
    with api.app.state.session_factory() as session, session.begin():
        row = session.get(Job, job["id"])
        row.state, row.started_at = "Succeeded", began
        row.finished_at = began + dt.timedelta(seconds=30)
        session.execute(insert(Event.__table__), [event_row(
            "Scheduled", "placed", now=began, job_id=job["id"], device_id=phone["device_id"])])
    # 0-10 s on its charger (12 W into the battery), unplugged at 10 s, 4 W from the battery
    # to 30 s; the charger's 10 s count nothing, nor the stretch from the last charging sample
    reports = [(0, 12.0, True), (10, 12.0, True), (15, 4.0, False), (30, 4.0, False)]
    body = {"telemetry": [sample((began + dt.timedelta(seconds=t)).timestamp(), power_w=w,
                                 charging=c) for t, w, c in reports]}
    assert api.heartbeat(phone, body).is_success
    got = value(scrape(api.client.get("/metrics").text), "phalanx_job_energy_joules",
                job_id=job["id"])
    assert got == 15 * 4.0

def test_each_steps_energy_is_its_phones_power_over_the_steps_time(api) -> None:
    """`GET /v1/jobs/{id}/metrics` (the job report's energy chart): each step gets the joules
    its phones drew between the previous step's commit and its own, a phone counted from when
    it joined; a step the phones have not yet reported past has none yet."""
    first, second = api.register("first"), api.register("second")
    job = api.post("/v1/jobs", json={"name": "curve", "model": {"arch": "mlp"},
                                      "dataset": "digits", "global_batch_size": 64,
                                      "shards": 4, "epochs": 1}).json()
    began = api.clock.now - dt.timedelta(seconds=60)

    def at(s: float) -> dt.datetime:
        return began + dt.timedelta(seconds=s)

    with api.app.state.session_factory() as session, session.begin():
        row = session.get(Job, job["id"])
        row.state, row.started_at = "Running", began
        session.add_all([ShardAssignment(job_id=job["id"], shard=0, device_id=first["device_id"]),
                         ShardAssignment(job_id=job["id"], shard=1, device_id=second["device_id"])])
        session.execute(insert(Event.__table__), [event_row(  # the second joins at 6 s
            "ShardsMoved", "joined", now=at(6), job_id=job["id"], device_id=second["device_id"])])
        # steps committed at 4, 8 and 12 s
        session.add_all([StepMetric(job_id=job["id"], step=t, ts=at(4 * (t + 1)), samples=64)
                         for t in range(3)])
    # the first phone: 2 W at 0 s rising to 4 W at 10 s; the second 5 W flat, reported to 10 s
    for phone, reports in ((first, [(0, 2.0), (10, 4.0)]), (second, [(0, 5.0), (10, 5.0)])):
        body = {"telemetry": [sample(at(s).timestamp(), power_w=w) for s, w in reports]}
        assert api.heartbeat(phone, body).is_success

    def energy(since_step: int = 0) -> list[float | None]:
        curve = api.get(f"/v1/jobs/{job['id']}/metrics?since_step={since_step}").json()
        return [point["energy_j"] for point in curve["items"]]

    # 0-4 s: the first alone, 2 -> 2.8 W; 4-8 s: the first 2.8 -> 3.6 W, the second from 6 s;
    # 8-12 s: not reported to its end by either phone yet
    assert energy() == pytest.approx([4 * 2.4, 4 * 3.2 + 2 * 5.0, None])
    assert energy(since_step=1) == pytest.approx([4 * 3.2 + 2 * 5.0, None])

    def report(phone: dict, watts: float) -> None:
        assert api.heartbeat(phone, {"telemetry": [sample(at(14).timestamp(), power_w=watts)]}
                             ).is_success

    report(first, 4.0)
    assert energy()[2] is None  # the second may still report
    with api.app.state.session_factory() as session, session.begin():
        session.get(Device, second["device_id"]).state = "NotReady"  # its lease expired
    assert energy()[2] == pytest.approx(2 * 3.8 + 2 * 4.0 + 2 * 5.0)  # what is known of it
    report(second, 5.0)  # back, with its buffered sample
    assert energy()[2] == pytest.approx(2 * 3.8 + 2 * 4.0 + 4 * 5.0)

    # final values are kept in the steps' rows: they outlive the samples (pruned after the
    # retention); a step nobody read before its samples went says it is not known, not 0 J
    kept = energy()
    with api.app.state.session_factory() as session, session.begin():
        session.execute(delete(TelemetrySample))
        session.add(StepMetric(job_id=job["id"], step=3, ts=at(16), samples=64))
    api.clock.advance(api.settings.telemetry_retention_s + 60)
    assert energy() == pytest.approx([*kept, None])

def test_request_counts_add_up_across_two_worker_processes(pg_url: str, redis_url: str,
                                                            tmp_path: Path) -> None:
    multiproc = tmp_path / "metrics-mp"
    multiproc.mkdir()
    server = start_server(database_url=pg_url, redis_url=redis_url, data_dir=tmp_path / "data",
                          admin_token=ADMIN, args=["--workers", "2"],
                          extra_env={"PROMETHEUS_MULTIPROC_DIR": str(multiproc)})
    try:
        before = total(scrape(httpx.get(f"{server.url}/metrics").text),
                       "phalanx_http_requests_total", route="/healthz")

        def one(_: int) -> int:
            with httpx.Client() as c:  # a new connection each time, so both workers take some
                return c.get(f"{server.url}/healthz").status_code

        with ThreadPoolExecutor(16) as pool:
            assert set(pool.map(one, range(200))) == {200}
        files = {p.name for p in multiproc.iterdir()}
        pids = {name.rsplit("_", 1)[-1] for name in files if name.startswith("counter_")}
        assert len(pids) == 2, f"both workers should have counted requests: {sorted(files)}"
        for _ in range(4):  # whichever worker answers the scrape reports the sum of both
            samples = scrape(httpx.get(f"{server.url}/metrics").text)
            assert total(samples, "phalanx_http_requests_total", route="/healthz") == before + 200
    finally:
        server.stop()


def test_metrics_still_answer_when_a_source_fails_and_say_which(sqlite_url, tmp_path) -> None:
    """Redis down: the queue depths and task histograms cannot be read; the page still comes,
    with the store's gauges, and `phalanx_metrics_source_up` names what is missing."""
    app = create_app(make_settings(sqlite_url, tmp_path / "d", redis_url="redis://127.0.0.1:1/0"))
    with TestClient(app) as client:
        resp = client.get("/metrics")
    app.state.engine.dispose()
    assert resp.status_code == 200
    samples = scrape(resp.text)
    assert value(samples, "phalanx_metrics_source_up", source="store") == 1
    assert value(samples, "phalanx_metrics_source_up", source="queues") == 0
    assert value(samples, "phalanx_metrics_source_up", source="tasks") == 0
    assert value(samples, "phalanx_devices_registered") == 0  # the store's gauges are there


def job_series(api) -> set[str]:
    """The job ids that have a `phalanx_job_step` series on /metrics now."""
    return {dict(labels)["job_id"] for (name, labels) in scrape(api.client.get("/metrics").text)
            if name == "phalanx_job_step"}


def test_job_series_are_live_jobs_and_those_finished_within_6_hours_at_most_50(api) -> None:
    """Prometheus cost stays bounded however many jobs a lab runs: live jobs and jobs finished
    in the last 6 hours get series, the newest 50 of them."""
    from domain.store.db import transaction
    from domain.store.models import Job

    now = api.clock()
    spec = {"name": "j", "model": {"arch": "logreg"}, "dataset": "digits"}

    def add(state: str, created_min_ago: float, finished_h_ago: float | None = None) -> str:
        with transaction(api.app.state.session_factory) as s:
            job = Job(name="j", spec=spec, state=state, priority=0, step=0, total_steps=5,
                      created=now - dt.timedelta(minutes=created_min_ago),
                      finished_at=None if finished_h_ago is None
                      else now - dt.timedelta(hours=finished_h_ago))
            s.add(job)
            s.flush()
            return job.id

    stale = add("Succeeded", 600, finished_h_ago=7)
    recent = add("Failed", 500, finished_h_ago=5)
    live = add("Running", 400)
    assert job_series(api) == {recent, live}  # the one finished 7 h ago has gone
    newer = [add("Pending", 300 - i) for i in range(55)]
    shown = job_series(api)
    assert len(shown) == 50 and shown == set(newer[-50:])  # the newest 50
    assert stale not in shown


def test_the_buffer_pool_shows_what_it_holds_and_hands_out_again(api) -> None:
    """phalanx_buffer_pool_bytes and _reused_total follow the process's pool (wire.buffers): the
    operator sees the memory it keeps (PHALANX_BUFFER_POOL_MB) and whether it is used."""
    api.client.get("/metrics")  # the app has started: the pool is watched
    first = new_buffer(3 * POOLED_MIN_BYTES + 12345)
    held = scrape(api.client.get("/metrics").text)
    assert value(held, "phalanx_buffer_pool_bytes") == BUFFERS.held_bytes >= 3 * POOLED_MIN_BYTES
    del first
    again = new_buffer(3 * POOLED_MIN_BYTES + 12345)  # the same buffer, nothing else holds it
    after = scrape(api.client.get("/metrics").text)
    assert value(after, "phalanx_buffer_pool_reused_total") == \
        value(held, "phalanx_buffer_pool_reused_total") + 1
    del again
