"""deploy/grafana: the committed dashboards are what build_dashboards.py writes, their uids are
fixed and unique, every datasource they name is provisioned, and every SQL query (panels and
variables) runs against the real Postgres schema with its variables filled in."""

from __future__ import annotations

import importlib.util
import re
from typing import Any

import psycopg
import pytest
import yaml

from tests.deploy.tools import DEPLOY, fill_sql, load_dashboards, queries, variable_queries

GRAFANA = DEPLOY / "grafana"
EXPECTED_UIDS = {"fleet.json": "phalanx-fleet", "device.json": "phalanx-device",
                 "job.json": "phalanx-job"}


def provisioned_datasources() -> dict[str, dict[str, Any]]:
    doc = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "datasources.yml").read_text())
    return {ds["uid"]: ds for ds in doc["datasources"]}


def test_committed_dashboards_are_what_the_builder_writes() -> None:
    spec = importlib.util.spec_from_file_location("build_dashboards",
                                                  GRAFANA / "build_dashboards.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rendered = module.render()
    assert set(rendered) == set(EXPECTED_UIDS)
    for name, text in rendered.items():
        committed = (GRAFANA / "dashboards" / name).read_text()
        assert committed == text, f"{name} is stale: run deploy/grafana/build_dashboards.py"


def test_dashboards_have_their_fixed_unique_uids_and_panel_ids() -> None:
    boards = load_dashboards()
    assert {name: b["uid"] for name, b in boards.items()} == EXPECTED_UIDS
    for name, board in boards.items():
        ids = [p["id"] for p in board["panels"]]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
        titles = [p["title"] for p in board["panels"]]
        assert all(titles), f"{name}: a panel without a title"


def test_every_datasource_a_dashboard_names_is_provisioned_with_its_type() -> None:
    provisioned = provisioned_datasources()
    assert set(provisioned) == {"phalanx-prometheus", "phalanx-postgres"}
    for name, board in load_dashboards().items():
        refs = [p["datasource"] for p in board["panels"]]
        refs += [t["datasource"] for p in board["panels"] for t in p["targets"]]
        refs += [v["datasource"] for v in board["templating"]["list"] if "datasource" in v]
        for ref in refs:
            assert ref["uid"] in provisioned, f"{name}: unknown datasource {ref}"
            assert provisioned[ref["uid"]]["type"] == ref["type"], f"{name}: {ref}"


def test_the_dashboard_provider_loads_from_where_compose_mounts_the_files() -> None:
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "dashboards.yml")
                              .read_text())["providers"][0]
    compose = yaml.safe_load((DEPLOY.parent / "docker-compose.yml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert f"./deploy/grafana/dashboards:{provider['options']['path']}:ro" in mounts


def test_the_fleet_dashboard_covers_what_operators_asked_for() -> None:
    exprs = " ".join(q.text for q in queries("prometheus") if q.dashboard == "fleet.json")
    for metric in ("phalanx_devices", "phalanx_fleet_cpu_temperature_celsius_bucket",
                   "phalanx_fleet_battery_percent_bucket", "phalanx_fleet_power_watts_bucket",
                   "phalanx_devices_throttled", "phalanx_devices_paused",
                   "phalanx_device_enrollments_total"):
        assert metric in exprs
    for expr in (q.text for q in queries("prometheus")):
        assert "device_id" not in expr, "fleet metrics never carry a device id label"


def test_every_sql_query_runs_against_the_migrated_schema(pg_url: str) -> None:
    """On an empty, migrated database: a wrong table or column fails here."""
    all_queries = [*queries("sql"), *variable_queries()]
    assert len(all_queries) >= 12
    variables = {"device": "no-such-device", "job_id": "no-such-job"}
    with psycopg.connect(pg_url.replace("postgresql+psycopg://", "postgresql://")) as conn:
        for q in all_queries:
            try:
                conn.execute(fill_sql(q.text, variables)).fetchall()
            except psycopg.Error as exc:
                pytest.fail(f"{q.dashboard} / {q.panel} ({q.ref}): {exc}\n{q.text}")
            conn.rollback()


def test_a_broken_sql_panel_would_be_caught(pg_url: str) -> None:
    query = fill_sql("SELECT ts AS time, no_such_column FROM telemetry_samples "
                     "WHERE device_id = '$device' AND $__timeFilter(ts)", {"device": "x"})
    assert not re.search(r"\$", query)
    with psycopg.connect(pg_url.replace("postgresql+psycopg://", "postgresql://")) as conn, \
            pytest.raises(psycopg.errors.UndefinedColumn):
        conn.execute(query)


def test_the_fleet_dashboard_has_the_rack_table_hottest_first_linking_to_each_device() -> None:
    import json

    fleet = json.loads((DEPLOY / "grafana" / "dashboards" / "fleet.json").read_text())
    (table,) = [p for p in fleet["panels"] if p["title"] == "Phones, hottest first"]
    assert table["type"] == "table" and table["datasource"]["uid"] == "phalanx-postgres"
    query = table["targets"][0]["rawSql"]
    for column in ("phone", "state", "paused", "cpu_c", "battery_c", "battery_pct", "labels",
                   "last_seen"):
        assert f" AS {column}" in query
    assert "ORDER BY GREATEST(" in query and "DESC" in query
    links = [prop["value"] for o in table["fieldConfig"]["overrides"]
             for prop in o["properties"] if prop["id"] == "links"]
    assert links == [[{"title": "Device dashboard",
                       "url": "/d/phalanx-device?var-device=${__data.fields.id}"}]]


def test_grafanas_database_role_reads_every_table_now_and_later_and_writes_nothing(
        pg_url: str) -> None:
    """deploy/postgres/grafana-readonly.sql run with the real psql on a migrated database, then
    used as Grafana uses it."""
    import shutil
    import subprocess

    from sqlalchemy.engine import make_url

    url = make_url(pg_url)
    psql = shutil.which("psql")
    assert psql, "the test needs PostgreSQL's psql client (Debian: postgresql-client)"
    base = [psql, "-h", url.host or "127.0.0.1", "-p", str(url.port or 5432), "-d",
            url.database or "", "-v", "ON_ERROR_STOP=1"]
    script = DEPLOY / "postgres" / "grafana-readonly.sql"
    owner = url.username or "postgres"
    for _ in range(2):  # idempotent: a second run changes nothing and fails on nothing
        subprocess.run([*base, "-U", owner, "-v", "grafana_password=test-only", "-v",
                        f"owner={owner}", "-f", str(script)], check=True, capture_output=True)
    # a table a later migration adds is readable too (the owner's default privileges)
    subprocess.run([*base, "-U", owner, "-c", "CREATE TABLE later_table (x int)"], check=True,
                   capture_output=True)
    as_grafana = psycopg.connect(host=url.host, port=url.port, dbname=url.database,
                                 user="grafana_ro", password="test-only", autocommit=True)
    with as_grafana:
        as_grafana.execute("SELECT count(*) FROM devices").fetchone()
        as_grafana.execute("SELECT count(*) FROM later_table").fetchone()
        for write in ("INSERT INTO later_table VALUES (1)", "DELETE FROM devices",
                      "CREATE TABLE nope (x int)"):
            with pytest.raises(psycopg.Error):
                as_grafana.execute(write)
