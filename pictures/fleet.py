"""The server's own pages (`/ui`): the fleet and its jobs, and a login form. Plain HTML that
refreshes itself (`<meta http-equiv="refresh">`): no script, nothing fetched from elsewhere.
Input is what the API answers (devices, jobs), so the page shows what `phalanx devices ls`
and `phalanx jobs ls` show."""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

from pictures.numbers import percent, significant
from pictures.report import STYLE
from wire.states import DeviceState, JobState

# str keys: a state's value (an Enum member hashes by its name)
STATE_COLORS = {DeviceState.READY.value: "#16a34a", DeviceState.NOT_READY.value: "#dc2626",
                DeviceState.CORDONED.value: "#ca8a04", DeviceState.DRAINING.value: "#ca8a04",
                JobState.RUNNING.value: "#2563eb", JobState.PENDING.value: "#6b7280",
                JobState.SUCCEEDED.value: "#16a34a", JobState.FAILED.value: "#dc2626",
                JobState.CANCELLED.value: "#ca8a04"}
PAGE_STYLE = STYLE + """
table.list { border-collapse: collapse; margin: 8px 0 20px; }
table.list th, table.list td { padding: 3px 12px 3px 0; text-align: left; border-bottom: 1px solid #eee; }
.hot { color: #dc2626; font-weight: 600; } nav { margin-bottom: 12px; color: #555; }
form.login input { font: inherit; width: 28em; }
"""


def _e(value: Any) -> str:
    return "-" if value is None or value == "" else html.escape(str(value))


def _state(state: Any) -> str:
    color = STATE_COLORS.get(str(state), "#111")
    return f'<span style="color:{color}">{_e(state)}</span>'


def page(title: str, body: str, refresh_s: int | None = None) -> str:
    refresh = f'<meta http-equiv="refresh" content="{refresh_s}">' if refresh_s else ""
    return (f'<!doctype html><html lang="en"><head><meta charset="utf-8">{refresh}'
            f"<title>{html.escape(title)}</title><style>{PAGE_STYLE}</style></head><body>"
            f"{body}</body></html>")


def _temp(device: dict[str, Any], hot_c: float) -> str:
    tel = device.get("latest_telemetry") or {}
    temps = [t for t in (tel.get("cpu_temp_c"), tel.get("battery_temp_c"))
             if isinstance(t, (int, float))]
    if not temps:
        return "-"
    hottest = max(temps)
    return f'<span class="hot">{hottest:.1f}</span>' if hottest >= hot_c else f"{hottest:.1f}"


def fleet(devices: Sequence[dict[str, Any]], jobs: Sequence[dict[str, Any]],
          refresh_s: int = 5, hot_c: float = 45.0) -> str:
    """The fleet, hottest phone first, and the jobs, newest first, each linking to its page."""
    held: dict[str, int] = {}
    for job in jobs:
        for device, shards in (job.get("shards") or {}).items():
            held[device] = held.get(device, 0) + len(shards)

    def heat(d: dict[str, Any]) -> float:
        tel = d.get("latest_telemetry") or {}
        temps = [t for t in (tel.get("cpu_temp_c"), tel.get("battery_temp_c"))
                 if isinstance(t, (int, float))]
        return max(temps) if temps else -1.0

    rows = []
    for d in sorted(devices, key=heat, reverse=True):
        tel = d.get("latest_telemetry") or {}
        labels = ", ".join(f"{k}={v}" for k, v in sorted((d.get("labels") or {}).items()))
        battery = tel.get("battery_pct")
        rows.append(f'<tr data-device="{_e(d.get("id"))}"><td>{_e(d.get("name"))}</td>'
                    f"<td>{_state(d.get('state'))}</td><td>{_e(d.get('pause_reason'))}</td>"
                    f"<td>{_temp(d, hot_c)}</td>"
                    f"<td>{_e(None if battery is None else f'{battery:.0f}%')}"
                    f"{' ⚡' if tel.get('charging') else ''}</td>"
                    f"<td>{held.get(str(d.get('id')), 0)}</td><td>{_e(labels)}</td>"
                    f"<td>{_e(d.get('agent_version'))}</td>"
                    f"<td>{_e(d.get('compute_class'))}</td></tr>")
    job_rows = []
    for j in jobs:
        m = j.get("metrics") or {}
        loss, acc = m.get("train_loss"), m.get("val_accuracy")
        job_rows.append(
            f'<tr data-job="{_e(j.get("id"))}"><td><a href="/ui/jobs/{_e(j.get("id"))}">'
            f"{_e(j.get('name'))}</a></td><td>{_state(j.get('state'))}</td>"
            f"<td>{_e(j.get('step'))}/{_e(j.get('total_steps'))}</td>"
            f"<td>{_e(None if loss is None else significant(loss))}</td>"
            f"<td>{_e(None if acc is None else percent(acc))}</td>"
            f"<td>{len(j.get('devices') or [])}</td><td>{_e(j.get('reason'))}</td></tr>")
    ready = sum(1 for d in devices if d.get("state") == DeviceState.READY)
    body = (f"<h1>Phalanx</h1><nav>{ready} of {len(devices)} phones Ready · "
            f"{sum(1 for j in jobs if j.get('state') == JobState.RUNNING)} job(s) running · refreshes "
            f'every {refresh_s} s · <a href="/ui/logout">log out</a></nav>'
            f"<h2>Fleet</h2><table class=\"list fleet\"><tr><th>phone</th><th>state</th>"
            f"<th>paused</th><th>°C</th><th>battery</th><th>shards</th><th>labels</th>"
            f"<th>agent</th><th>compute class</th></tr>{''.join(rows)}</table>"
            f"<h2>Jobs</h2><table class=\"list jobs\"><tr><th>job</th><th>state</th>"
            f"<th>step</th><th>loss</th><th>val acc</th><th>phones</th><th>reason</th></tr>"
            f"{''.join(job_rows)}</table>")
    return page("Phalanx fleet", body, refresh_s)


def login(message: str = "") -> str:
    note = f'<p class="hot">{html.escape(message)}</p>' if message else ""
    body = (f"<h1>Phalanx</h1>{note}<form class=\"login\" method=\"post\" action=\"/ui/login\">"
            f"<p>An admin or user token (<code>phalanx tokens create</code>):</p>"
            f'<p><input type="password" name="token" autocomplete="current-password" '
            f'autofocus> <button type="submit">Open</button></p></form>')
    return page("Phalanx: log in", body)
