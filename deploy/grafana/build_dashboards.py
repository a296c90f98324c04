"""Writes the Fleet, Device and Job dashboards (deploy/grafana/dashboards/*.json).

The JSON files are committed; this script is their source. Run it after editing a panel:
    .venv/bin/python deploy/grafana/build_dashboards.py
tests/deploy checks that the committed files match its output, that every PromQL expression
returns data from a real Prometheus scraping a real server, and that every SQL query runs
against the real schema.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

PROM = {"type": "prometheus", "uid": "phalanx-prometheus"}
PG = {"type": "grafana-postgresql-datasource", "uid": "phalanx-postgres"}
OUT = Path(__file__).resolve().parent / "dashboards"

Panel = dict[str, Any]


class Layout:
    """Places panels left to right on a 24-column grid and numbers them."""

    def __init__(self) -> None:
        self.x = self.y = self.row_h = 0
        self.next_id = 1

    def place(self, panel: Panel, w: int, h: int) -> Panel:
        if self.x + w > 24:
            self.x, self.y = 0, self.y + self.row_h
            self.row_h = 0
        panel.update(id=self.next_id, gridPos={"x": self.x, "y": self.y, "w": w, "h": h})
        self.next_id += 1
        self.x += w
        self.row_h = max(self.row_h, h)
        return panel


def prom(expr: str, legend: str = "", fmt: str = "time_series", ref: str = "A") -> dict[str, Any]:
    return {"refId": ref, "datasource": PROM, "expr": expr, "legendFormat": legend,
            "format": fmt, "range": True}


def sql(query: str, fmt: str = "time_series", ref: str = "A") -> dict[str, Any]:
    return {"refId": ref, "datasource": PG, "rawQuery": True, "editorMode": "code",
            "rawSql": " ".join(query.split()), "format": fmt}


def panel(kind: str, title: str, targets: list[dict[str, Any]], unit: str = "short",
          description: str = "", **options: Any) -> Panel:
    ds = targets[0]["datasource"]
    out: Panel = {"type": kind, "title": title, "datasource": ds, "targets": targets,
                  "description": description,
                  "fieldConfig": {"defaults": {"unit": unit}, "overrides": []}}
    out.update(options)
    return out


def heatmap(title: str, metric: str, unit: str) -> Panel:
    return panel("heatmap", title, [prom(f"max by (le) ({metric}_bucket)", "{{le}}", "heatmap")],
                 unit, description="Live phones per bucket of their latest reading "
                 "(a snapshot histogram: buckets are read directly, never rate()).",
                 options={"calculate": False, "yAxis": {"unit": unit},
                          "cellGap": 1, "color": {"scheme": "Oranges", "mode": "scheme"}})


def dashboard(uid: str, title: str, panels: list[tuple[Panel, int, int]],
              variables: list[dict[str, Any]] | None = None, refresh: str = "10s") -> dict:
    layout = Layout()
    return {
        "uid": uid, "title": title, "tags": ["phalanx"], "timezone": "utc",
        "schemaVersion": 39, "version": 1, "editable": False, "refresh": refresh,
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": variables or []},
        "annotations": {"list": []},
        "panels": [layout.place(p, w, h) for p, w, h in panels],
    }


# the rack view: every phone, hottest first, each name a link to its device dashboard
FLEET_TABLE = """
SELECT d.name AS phone, d.id AS id, d.state AS state,
       COALESCE(d.pause_reason, '') AS paused,
       CAST(d.latest_telemetry ->> 'cpu_temp_c' AS double precision) AS cpu_c,
       CAST(d.latest_telemetry ->> 'battery_temp_c' AS double precision) AS battery_c,
       CAST(d.latest_telemetry ->> 'battery_pct' AS double precision) AS battery_pct,
       CAST(d.labels AS text) AS labels, d.lease_renewed_at AS last_seen
FROM devices AS d
ORDER BY GREATEST(COALESCE(CAST(d.latest_telemetry ->> 'cpu_temp_c' AS double precision), -1),
                  COALESCE(CAST(d.latest_telemetry ->> 'battery_temp_c' AS double precision), -1))
         DESC, d.name
LIMIT 1000
"""


def buffer_pool_panel(rate: str) -> Panel:
    """What the servers keep of a step's model-sized buffers (PHALANX_BUFFER_POOL_MB), and how
    often one is handed out again instead of fresh pages."""
    out = panel("timeseries", "Data plane: buffers kept and reused", [
        prom("sum(phalanx_buffer_pool_bytes)", "kept"),
        prom(f"sum(rate(phalanx_buffer_pool_reused_total[{rate}]))", "reused", ref="B")],
        "bytes", description="Bytes of uploads, states and weights messages the API replicas "
        "keep to hand out again (PHALANX_BUFFER_POOL_MB), and buffers reused a second: about "
        "(phones + 2) a step when the pool is big enough; 0 with a pool too small for a step.")
    out["fieldConfig"]["overrides"] = [{"matcher": {"id": "byName", "options": "reused"},
                                        "properties": [{"id": "unit", "value": "ops"}]}]
    return out


def audit_panels(rate: str) -> list[tuple[Panel, int, int]]:
    """Audits (docs/scheduler.md, "Audits"): nodes compared and how they came out, and every
    phone quarantined for a result that two others disagreed with, with why."""
    compared = panel("timeseries", "Audits: nodes compared, mismatches, decisions", [
        prom(f"max by (outcome) (rate(phalanx_audits_total[{rate}]))", "{{outcome}}"),
        prom(f"max by (outcome) (rate(phalanx_audit_decisions_total[{rate}]))",
             "decided: {{outcome}}", ref="B")], "ops",
        description="Applied results compared byte for byte with a second phone's "
        "(verification.audit_rate of the nodes, every node of a phone on probation): agreed, "
        "or a mismatch that a third phone decides (the holder or the auditor lost; no "
        "majority: all computed again).")
    quarantined = panel("table", "Quarantined phones", [sql(QUARANTINED, "table"), prom(
        "max by (device) (phalanx_quarantines_total)", "{{device}}", "table", ref="B")],
        description="Phones cordoned because an audit found their result wrong (two of three "
        "agreed against it), with the reason; `phalanx devices uncordon` lifts it (an event "
        "names who). B: quarantines counted per phone name since the counters began.")
    return [(compared, 12, 8), (quarantined, 12, 8)]


QUARANTINED = """
    SELECT name AS phone, id, state, quarantine_reason AS reason, updated AS since
    FROM devices WHERE quarantine_reason IS NOT NULL ORDER BY updated DESC
"""


def fleet_table() -> Panel:
    link = {"title": "Device dashboard", "url": "/d/phalanx-device?var-device=${__data.fields.id}"}
    table = panel("table", "Phones, hottest first", [sql(FLEET_TABLE, "table")],
                  description="Every phone with its state, why its agent paused, its latest "
                  "temperatures and charge, labels and when it last renewed its lease. Click a "
                  "name for its device dashboard.")
    table["fieldConfig"]["overrides"] = [
        {"matcher": {"id": "byName", "options": "phone"},
         "properties": [{"id": "links", "value": [link]}]},
        {"matcher": {"id": "byName", "options": "id"},
         "properties": [{"id": "custom.hidden", "value": True}]},
        {"matcher": {"id": "byRegexp", "options": "cpu_c|battery_c"},
         "properties": [{"id": "unit", "value": "celsius"}]},
        {"matcher": {"id": "byName", "options": "battery_pct"},
         "properties": [{"id": "unit", "value": "percent"}]},
    ]
    return table


def fleet() -> dict:
    rate = "$__rate_interval"
    return dashboard("phalanx-fleet", "Phalanx / Fleet", [
        (fleet_table(), 24, 10),
        (panel("stat", "Devices by state", [prom("max by (state) (phalanx_devices)", "{{state}}")],
               options={"options": {"reduceOptions": {"calcs": ["lastNotNull"]}}}), 8, 5),
        (panel("stat", "Jobs by state", [prom("max by (state) (phalanx_jobs)", "{{state}}")],
               options={"options": {"reduceOptions": {"calcs": ["lastNotNull"]}}}), 8, 5),
        (panel("stat", "Fleet power", [prom("max(phalanx_fleet_power_total_watts)", "watts")],
               "watt"), 4, 5),
        (panel("stat", "Enrolled (total)", [prom("max(phalanx_device_enrollments_total)",
                                                 "enrolled")]), 4, 5),
        (panel("timeseries", "Devices by state", [prom("max by (state) (phalanx_devices)",
                                                       "{{state}}")]), 12, 8),
        (panel("timeseries", "Throttling and phone-first pauses", [
            prom("max(phalanx_devices_throttled)", "throttled"),
            prom("max by (reason) (phalanx_devices_paused)", "paused: {{reason}}", ref="B"),
            prom("max(phalanx_devices_busy)", "in use by a person", ref="C"),
        ]), 12, 8),
        (heatmap("CPU temperature", "phalanx_fleet_cpu_temperature_celsius", "celsius"), 12, 8),
        (heatmap("Battery temperature", "phalanx_fleet_battery_temperature_celsius", "celsius"),
         12, 8),
        (heatmap("Battery charge", "phalanx_fleet_battery_percent", "percent"), 12, 8),
        (heatmap("Power draw", "phalanx_fleet_power_watts", "watt"), 12, 8),
        (panel("timeseries", "Hottest phone", [
            prom("max by (sensor) (phalanx_fleet_max_temperature_celsius)", "{{sensor}}")],
            "celsius"), 12, 8),
        (panel("timeseries", "Enrollments", [
            prom(f"max(increase(phalanx_device_enrollments_total[{rate}]))", "enrolled")]), 12, 8),
        (panel("timeseries", "API requests by route", [
            prom(f"sum by (route) (rate(phalanx_http_requests_total[{rate}]))", "{{route}}")],
            "reqps"), 12, 8),
        (panel("timeseries", "API latency p99 by route", [
            prom("histogram_quantile(0.99, sum by (le, route) "
                 f"(rate(phalanx_http_request_duration_seconds_bucket[{rate}])))", "{{route}}")],
            "s"), 12, 8),
        (panel("timeseries", "API errors (5xx)", [
            prom(f'sum(rate(phalanx_http_requests_total{{status=~"5.."}}[{rate}])) or vector(0)',
                 "5xx/s")], "reqps"), 8, 8),
        (panel("timeseries", "Scheduler task time p95", [
            prom("histogram_quantile(0.95, max by (le, task) "
                 f"(rate(phalanx_task_duration_seconds_bucket[{rate}])))", "{{task}}")],
            "s"), 8, 8),
        (panel("timeseries", "Scheduler runs", [
            prom(f"max by (task, outcome) (rate(phalanx_task_runs_total[{rate}]))",
                 "{{task}} {{outcome}}")], "ops"), 8, 8),
        (panel("timeseries", "Since the last successful run", [
            prom("time() - max by (task) (phalanx_task_last_success_timestamp_seconds)",
                 "{{task}}")], "s"), 12, 8),
        (panel("timeseries", "Queue depth", [prom("max by (queue) (phalanx_queue_depth)",
                                                  "{{queue}}")]), 12, 8),
        # the data plane: partials are one upload for several shards (pre-added on the phone);
        # a sliced job's slices served ahead of their step's commit overlap the apply
        (panel("timeseries", "Data plane: uploads and weights slices", [
            prom(f"sum by (kind) (rate(phalanx_uploaded_results_total[{rate}]))",
                 "upload: {{kind}}"),
            prom(f"sum by (when) (rate(phalanx_weights_slices_served_total[{rate}]))",
                 "slice served {{when}}", ref="B")], "ops"), 12, 8),
        (buffer_pool_panel(rate), 12, 8),
        *audit_panels(rate),
    ])


DEVICE_VAR = {
    "name": "device", "label": "Device", "type": "query", "datasource": PG,
    "query": "SELECT id AS __value, name || ' (' || id || ')' AS __text FROM devices ORDER BY name",
    "definition": "devices", "refresh": 1, "multi": False, "includeAll": False, "sort": 1,
}


def device() -> dict:
    where = "device_id = '$device' AND $__timeFilter(ts)"
    series = (
        ("Temperature", "celsius", "cpu_temp_c AS cpu, battery_temp_c AS battery"),
        ("Battery", "percent", "battery_pct AS battery"),
        ("Power", "watt", "power_w AS power"),
        ("CPU frequency", "rotmhz", "cpu_freq_mhz AS cpu_freq"),
        ("Throttled / in use", "short", "CASE WHEN throttled THEN 1 ELSE 0 END AS throttled, "
                                        "CASE WHEN busy THEN 1 ELSE 0 END AS busy"),
    )
    panels: list[tuple[Panel, int, int]] = [
        (panel("table", "Device", [sql(
            "SELECT name, state, pause_reason, cordoned, draining, agent_version, "
            "lease_renewed_at, latest_telemetry_at, CAST(labels AS text) AS labels, "
            "CAST(spec AS text) AS spec FROM devices WHERE id = '$device'", "table")]), 24, 5),
    ]
    for title, unit, columns in series:
        query = (f"SELECT ts AS time, {columns} FROM telemetry_samples WHERE {where} "
                 "ORDER BY ts")
        panels.append((panel("timeseries", title, [sql(query)], unit), 12, 8))
    panels += [
        (panel("stat", "Shards held", [sql(
            "SELECT now() AS time, count(*) AS shards FROM shard_assignments "
            "WHERE device_id = '$device'")]), 4, 8),
        (panel("table", "Shards held by job", [sql(
            "SELECT job_id, role, count(*) AS shards, min(since_step) AS since_step "
            "FROM shard_assignments WHERE device_id = '$device' GROUP BY job_id, role "
            "ORDER BY job_id, role", "table")]), 8, 8),
        (panel("timeseries", "Shards moved onto this phone", [sql(
            "SELECT ts AS time, count(*) AS joined FROM events WHERE device_id = '$device' "
            "AND reason = 'DeviceJoined' AND $__timeFilter(ts) GROUP BY ts ORDER BY ts")]), 12, 8),
        (panel("table", "Events", [sql(
            "SELECT ts AS time, kind, reason, job_id, message FROM events "
            f"WHERE {where} ORDER BY ts DESC LIMIT 200", "table")]), 24, 8),
    ]
    return dashboard("phalanx-device", "Phalanx / Device", panels, [DEVICE_VAR], refresh="30s")


JOB_VAR = {
    "name": "job_id", "label": "Job", "type": "query", "datasource": PG,
    "query": "SELECT id AS __value, name || ' (' || state || ', ' || id || ')' AS __text "
             "FROM jobs ORDER BY created DESC LIMIT 100",
    "definition": "jobs", "refresh": 1, "multi": False, "includeAll": False,
}


def job() -> dict:
    sel = '{job_id="$job_id"}'
    steps = "FROM step_metrics WHERE job_id = '$job_id' AND $__timeFilter(ts) ORDER BY ts"
    return dashboard("phalanx-job", "Phalanx / Job", [
        (panel("gauge", "Progress", [prom(f"max(phalanx_job_progress_ratio{sel})", "progress")],
               "percentunit"), 6, 6),
        (panel("stat", "Step", [prom(f"max(phalanx_job_step{sel})", "step"),
                                prom(f"max(phalanx_job_total_steps{sel})", "of", ref="B")]), 6, 6),
        (panel("stat", "Battery energy", [prom(f"max(phalanx_job_energy_joules{sel})", "joules")],
               "joule"), 6, 6),
        (panel("stat", "Validation accuracy",
               [prom(f"max(phalanx_job_val_accuracy{sel})", "val accuracy")], "percentunit"),
         6, 6),
        (panel("timeseries", "Loss", [sql(f"SELECT ts AS time, train_loss, val_loss {steps}")]),
         12, 8),
        (panel("timeseries", "Accuracy", [sql(
            f"SELECT ts AS time, train_accuracy, val_accuracy {steps}")], "percentunit"), 12, 8),
        (panel("timeseries", "Samples per second", [
            prom(f"max(phalanx_job_samples_per_second{sel})", "samples/s"),
            sql(f"SELECT ts AS time, samples / NULLIF(step_seconds, 0) AS per_step {steps}",
                ref="B")], "short"), 12, 8),
        (panel("timeseries", "Step time", [
            prom(f"max(phalanx_job_step_seconds{sel})", "latest step"),
            sql(f"SELECT ts AS time, step_seconds {steps}", ref="B")], "s"), 12, 8),
        (panel("timeseries", "Devices", [
            prom(f"max(phalanx_job_devices{sel})", "holding shards"),
            sql(f"SELECT ts AS time, devices AS devices_at_step {steps}", ref="B")]), 12, 8),
        (panel("timeseries", "Battery energy over time", [
            prom(f"max(phalanx_job_energy_joules{sel})", "joules")], "joule"), 12, 8),
        (panel("timeseries", "Training loss (Prometheus)", [
            prom(f"max(phalanx_job_train_loss{sel})", "train loss"),
            prom(f"max(phalanx_job_train_accuracy{sel})", "train accuracy", ref="B")]), 12, 8),
        (panel("table", "Events", [sql(
            "SELECT ts AS time, kind, reason, device_id, message FROM events "
            "WHERE job_id = '$job_id' ORDER BY ts DESC LIMIT 200", "table")]), 12, 8),
    ], [JOB_VAR])


DASHBOARDS = {"fleet.json": fleet, "device.json": device, "job.json": job}


def render() -> dict[str, str]:
    return {name: json.dumps(build(), indent=2, sort_keys=True) + "\n"
            for name, build in DASHBOARDS.items()}


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    for name, text in render().items():
        (OUT / name).write_text(text)
        print(f"wrote {OUT / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
