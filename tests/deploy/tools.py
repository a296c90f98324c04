"""Real Prometheus tooling for tests/deploy: promtool, a Prometheus process, and the dashboards'
queries with Grafana's variables and macros filled in the way Grafana fills them."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.support.server import REPO_ROOT, free_port, stop_process

DEPLOY = REPO_ROOT / "deploy"
DASHBOARDS = DEPLOY / "grafana" / "dashboards"
HOW_TO = ("run the suite through ./scripts/test (it installs Debian's prometheus package when it "
          "can), or install Prometheus and promtool and put them on PATH")


def tool(name: str) -> str:
    """The promtool / prometheus binary: $PHALANX_TEST_<NAME>, else PATH; fails saying how."""
    path = os.environ.get(f"PHALANX_TEST_{name.upper()}") or shutil.which(name)
    if not path:
        pytest.fail(f"{name} is not installed: {HOW_TO}")
    return path


def promtool(*args: str, cwd: Path = REPO_ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([tool("promtool"), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, check=False)


# -- dashboards ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Query:
    dashboard: str
    panel: str
    ref: str
    kind: str  # "prometheus" | "sql"
    text: str


def load_dashboards() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def queries(kind: str) -> Iterator[Query]:
    for name, board in load_dashboards().items():
        for panel in board["panels"]:
            for target in panel.get("targets", []):
                ds_type = target["datasource"]["type"]
                if kind == "prometheus" and ds_type == "prometheus":
                    yield Query(name, panel["title"], target["refId"], kind, target["expr"])
                elif kind == "sql" and ds_type.endswith("postgresql-datasource"):
                    yield Query(name, panel["title"], target["refId"], kind, target["rawSql"])


def variable_queries() -> Iterator[Query]:
    for name, board in load_dashboards().items():
        for var in board["templating"]["list"]:
            if var.get("type") == "query":
                yield Query(name, f"variable {var['name']}", "-", "sql", var["query"])


RATE_INTERVAL = "20s"  # Grafana: max(4 x scrape interval, step + scrape); scrapes here are 1 s


def fill_promql(expr: str, variables: dict[str, str]) -> str:
    expr = expr.replace("$__rate_interval", RATE_INTERVAL).replace("$__interval", "5s")
    for name, value in variables.items():
        expr = expr.replace(f"${name}", value)
    assert "$" not in expr, f"unfilled variable in {expr!r}"
    return expr


def fill_sql(query: str, variables: dict[str, str]) -> str:
    # Grafana's PostgreSQL macro: $__timeFilter(col) -> col BETWEEN '<from>' AND '<to>'
    query = re.sub(r"\$__timeFilter\((\w+)\)",
                   r"\1 BETWEEN now() - interval '1 day' AND now() + interval '1 hour'", query)
    for name, value in variables.items():
        query = query.replace(f"${name}", value.replace("'", "''"))
    assert "$" not in query, f"unfilled variable in {query!r}"
    return query


# -- a Prometheus process ----------------------------------------------------------------------

@dataclass
class Prometheus:
    url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def api(self, path: str, **params: Any) -> Any:
        r = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=30)
        body = r.json()
        assert body.get("status") == "success", f"{path} {params}: {body}"
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        return data["result"] if data["resultType"] in ("vector", "matrix") else [data["result"]]

    def stop(self) -> None:
        stop_process(self.process)


def prometheus_config(target: str, workdir: Path) -> Path:
    """deploy/prometheus/prometheus.yml, pointed at `target`, scraping and evaluating every
    second; the alert rules are the committed file, copied beside it as the config expects."""
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    config["global"].update(scrape_interval="1s", evaluation_interval="1s", scrape_timeout="1s")
    for job in config["scrape_configs"]:
        if job["job_name"] == "phalanx-api":
            job["static_configs"] = [{"targets": [target]}]
    config["scrape_configs"] = [j for j in config["scrape_configs"] if j["job_name"] != "prometheus"]
    workdir.mkdir(parents=True, exist_ok=True)
    shutil.copy(DEPLOY / "prometheus" / "alerts.yml", workdir / "alerts.yml")
    path = workdir / "prometheus.yml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def start_prometheus(target: str, workdir: Path, timeout_s: float = 60) -> Prometheus:
    config = prometheus_config(target, workdir)
    port = free_port()
    log_path = workdir / "prometheus.log"
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [tool("prometheus"), f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            cwd=workdir, stdout=log, stderr=subprocess.STDOUT)
    prom = Prometheus(f"http://127.0.0.1:{port}", proc, log_path)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"prometheus exited with {proc.returncode}:\n{prom.log()}")
        try:
            if httpx.get(f"{prom.url}/-/ready", timeout=2).status_code == 200:
                return prom
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    prom.stop()
    pytest.fail(f"prometheus not ready within {timeout_s}s:\n{prom.log()}")
