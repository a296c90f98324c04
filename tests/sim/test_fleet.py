"""`phalanx sim` against a live server: enrollment and heartbeats at scale, zero errors; with
--job, light phones train a real job over the step protocol."""

from __future__ import annotations

import datetime as dt
import json
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from engine.compute_class import fingerprint
from phalanx.cli.main import app
from phalanx.sim.fleet import Backoff, FleetOptions, run_fleet
from phalanx.train_local import run_reference
from tests.support.databases import migrated_sqlite
from tests.support.env import ADMIN_TOKEN
from tests.support.server import LiveServer, free_port, start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    base = tmp_path_factory.mktemp("fleet")
    srv = start_server(database_url=migrated_sqlite(base / "db.sqlite"), data_dir=base / "data",
                       admin_token=ADMIN_TOKEN)
    yield srv
    srv.stop()


def test_fleet_enrolls_heartbeats_reports_a_rate_and_cleans_up(server: LiveServer) -> None:
    report = run_fleet(FleetOptions(server=server.url, phones=60, duration_s=6, interval_s=1,
                                    admin_token=ADMIN_TOKEN, concurrency=16))
    assert report["errors"] == 0, report["errors_by_kind"]
    assert report["phones_enrolled"] == 60
    assert report["endpoints"]["register"]["requests"] == 60
    assert report["endpoints"]["heartbeat"]["requests"] >= 60
    # the rate is what was sent over the time it took (no speed is asserted: a busy machine)
    assert report["requests"] == sum(e["requests"] for e in report["endpoints"].values())
    assert report["elapsed_s"] >= 6
    assert report["requests_per_s"] == pytest.approx(report["requests"] / report["elapsed_s"],
                                                     rel=0.01, abs=0.1)
    assert report["latency_ms"]["p50"] > 0
    assert report["cleanup_errors"] == 0, report["cleanup_failures"]
    with server.client() as admin:
        assert admin.get("/v1/devices").json()["items"] == []


def test_cleanup_retries_a_delete_whose_pooled_connection_was_closed() -> None:
    # What a server closing an idle keep-alive connection looks like to httpx: a ReadError on the
    # first try. DELETE is idempotent, so cleanup tries again and reports only real failures.
    import asyncio

    import httpx

    from phalanx.sim.fleet import Fleet

    attempts: dict[str, int] = {}

    def server(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        attempts[path] = attempts.get(path, 0) + 1
        if path.endswith("/always-broken"):
            raise httpx.ReadError("connection closed", request=request)
        if attempts[path] == 1:
            raise httpx.ReadError("connection closed", request=request)
        return httpx.Response(404 if path.endswith("/gone") else 204)

    async def main() -> list[str]:
        http = httpx.AsyncClient(base_url="http://phalanx.test",
                                 transport=httpx.MockTransport(server))
        fleet = Fleet(FleetOptions(server="http://phalanx.test", phones=3,
                                   admin_token=ADMIN_TOKEN), http=http)
        for phone, device_id in zip(fleet.phones, ("dev-a", "gone", "always-broken")):
            phone.device_id = device_id
        try:
            return await fleet.cleanup()
        finally:
            await http.aclose()

    failures = asyncio.run(main())
    assert failures == ["always-broken: ReadError: connection closed"]
    assert attempts == {"/v1/devices/dev-a": 2, "/v1/devices/gone": 2,
                        "/v1/devices/always-broken": 3}


def test_the_sim_command_prints_requests_per_second_with_zero_errors(server: LiveServer) -> None:
    result = CliRunner().invoke(app, ["sim", "--phones", "20", "--duration", "4", "--interval",
                                      "1", "--server", server.url, "--token", ADMIN_TOKEN,
                                      "-o", "json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["errors"] == 0 and report["requests_per_s"] > 0
    table = CliRunner().invoke(app, ["sim", "--phones", "5", "--duration", "2", "--server",
                                     server.url, "--token", ADMIN_TOKEN], env={"COLUMNS": "200"})
    assert table.exit_code == 0, table.output
    assert "requests/s" in table.stdout and "errors: 0" in table.stdout


def test_without_an_admin_or_enrollment_token_sim_says_what_it_needs(server: LiveServer) -> None:
    result = CliRunner().invoke(app, ["sim", "--phones", "2", "--duration", "1", "--server",
                                      server.url], env={"PHALANX_TOKEN": None,
                                                        "PHALANX_CONFIG": "/nonexistent/c.json"})
    assert result.exit_code == 1
    assert "admin token" in result.stderr


@pytest.mark.parametrize("exactness", ["class", "portable"])
def test_light_phones_train_a_job_to_the_reference_trainers_result(server: LiveServer,
                                                                   exactness: str) -> None:
    """Light phones report this machine's compute class and the portable path: a job of
    either exactness runs on them (a class job pinned to this machine's class)."""
    job = {"name": "sim-logreg", "model": {"arch": "logreg"}, "dataset": "digits",
           "global_batch_size": 64, "shards": 8, "epochs": 1, "exactness": exactness,
           "placement": {"min_devices": 2, "max_devices": 8,
                         "selector": {"pool": f"sim-{exactness}"}}}
    report = run_fleet(FleetOptions(server=server.url, phones=8, duration_s=120, interval_s=1,
                                    admin_token=ADMIN_TOKEN, compute=True, job=job,
                                    labels={"pool": f"sim-{exactness}"}))
    assert report["job"]["state"] == "Succeeded", report
    assert report["job"]["compute_class"] == (fingerprint() if exactness == "class" else None)
    assert report["job"]["step"] == report["job"]["total_steps"]
    reference = run_reference(job, None, progress=False)  # `phalanx train --local`
    assert report["job"]["metrics"]["val_accuracy"] == pytest.approx(reference["val_accuracy"],
                                                                     abs=1e-9)
    assert report["job"]["metrics"]["train_loss"] == pytest.approx(reference["train_loss"],
                                                                   rel=1e-5)
    assert report["computed_shards"] >= 8 * report["job"]["total_steps"]
    assert report["errors"] == 0, report["errors_by_kind"]


def test_backoff_is_full_jitter_and_capped() -> None:
    backoff = Backoff(random.Random(1), base_s=0.5, cap_s=4.0)
    delays = [backoff.next_delay() for _ in range(50)]
    assert all(0 <= d <= 4.0 for d in delays)
    assert max(delays) > 2.0  # grows
    assert len({round(d, 3) for d in delays}) > 40  # spread, not lockstep
    backoff.reset()
    assert backoff.next_delay() <= 1.0


def test_after_a_control_plane_restart_every_phone_reconnects(tmp_path: Path) -> None:
    db, data, port = migrated_sqlite(tmp_path / "db.sqlite"), tmp_path / "data", free_port()
    srv = start_server(database_url=db, data_dir=data, admin_token=ADMIN_TOKEN, port=port)
    reports: list[dict[str, Any]] = []
    stop = threading.Event()
    opts = FleetOptions(server=srv.url, phones=30, duration_s=120, interval_s=1,
                        admin_token=ADMIN_TOKEN, backoff_cap_s=3.0, cleanup=False, stop=stop)
    runner = threading.Thread(target=lambda: reports.append(run_fleet(opts)), daemon=True)
    runner.start()
    try:
        with srv.client() as admin:
            deadline = time.monotonic() + 60
            while len(admin.get("/v1/devices").json()["items"]) < 30:
                assert time.monotonic() < deadline, "the fleet did not enroll"
                time.sleep(0.5)
        srv.stop(kill=True)
        time.sleep(2)
        srv = start_server(database_url=db, data_dir=data, admin_token=ADMIN_TOKEN, port=port)
        restarted = dt.datetime.now(dt.timezone.utc)

        def renewed_since_restart() -> int:
            with srv.client() as admin:
                devices = admin.get("/v1/devices").json()["items"]
            return sum(dt.datetime.fromisoformat(d["lease_renewed_at"]) > restarted
                       for d in devices if d["lease_renewed_at"])

        deadline = time.monotonic() + 60
        while renewed_since_restart() < 30:  # every phone heartbeats again after the restart
            assert time.monotonic() < deadline, f"{renewed_since_restart()}/30 phones reconnected"
            time.sleep(0.5)
        stop.set()
        runner.join(timeout=60)
        assert reports, "the fleet did not finish"
        report = reports[0]
        assert report["phones_enrolled"] == 30
        assert report["retries"] > 0
        kinds = {k.split(": ", 1)[1] for k in report["errors_by_kind"]}
        assert kinds <= {"ConnectError", "ReadError", "RemoteProtocolError", "ReadTimeout",
                         "WriteError", "500", "502", "503"}, kinds
    finally:
        stop.set()
        runner.join(timeout=60)
        srv.stop()
