"""The server's own pages (`/ui`): the fleet and its jobs, and a login form. Plain HTML that
refreshes itself (`<meta http-equiv="refresh">`): no script, nothing fetched from elsewhere; the
fleet sorts by a column through links (`?sort=battery`, `?sort=-battery`), which the refresh
keeps.
Input is what the API answers (devices, jobs), so the page shows what `phalanx devices ls`
and `phalanx jobs ls` show."""

from __future__ import annotations

import html
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pictures.chart import sparkline
from pictures.history import DeviceHistory
from pictures.numbers import percent, significant
from pictures.report import STYLE
from pictures.ticks import nice_ticks
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
table.fleet th a { color: inherit; } table.fleet td.num { white-space: nowrap; }
svg.spark { vertical-align: middle; margin-left: 6px; }
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


@dataclass(frozen=True)
class Column:
    key: str  # ?sort=key ascending, ?sort=-key descending
    title: str
    descending_first: bool  # numbers: the biggest first on the first click


COLUMNS = (Column("name", "phone", False), Column("state", "state", False),
           Column("paused", "paused", False), Column("temp", "°C", True),
           Column("battery", "battery", True), Column("rate", "samples/s", True),
           Column("shards", "shards", True), Column("labels", "labels", False),
           Column("agent", "agent", False), Column("class", "compute class", False))
DEFAULT_SORT = "-temp"  # the hottest phone first
BATTERY_AXIS = nice_ticks(0, 100)


def parse_sort(sort: str | None) -> tuple[str, bool]:
    """?sort= as (column key, descending); anything else: the hottest first."""
    text = sort if sort and sort.lstrip("-") in {c.key for c in COLUMNS} else DEFAULT_SORT
    return text.lstrip("-"), text.startswith("-")


def _heat(d: dict[str, Any]) -> float | None:
    tel = d.get("latest_telemetry") or {}
    temps = [t for t in (tel.get("cpu_temp_c"), tel.get("battery_temp_c"))
             if isinstance(t, (int, float))]
    return max(temps) if temps else None


def _labels(d: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted((d.get("labels") or {}).items()))


def sort_devices(devices: Sequence[dict[str, Any]], sort: str | None,
                 held: dict[str, int] | None = None,
                 history: dict[str, DeviceHistory] | None = None) -> list[dict[str, Any]]:
    """The devices in the page's order; a phone without the value sorts last either way."""
    key, descending = parse_sort(sort)
    held, history = held or {}, history or {}

    def value(d: dict[str, Any]) -> Any:
        tel = d.get("latest_telemetry") or {}
        return {"name": d.get("name"), "state": d.get("state"), "paused": d.get("pause_reason"),
                "temp": _heat(d), "battery": tel.get("battery_pct"),
                "rate": (history.get(str(d.get("id"))) or DeviceHistory()).latest_rate,
                "shards": held.get(str(d.get("id")), 0), "labels": _labels(d) or None,
                "agent": d.get("agent_version"), "class": d.get("compute_class")}[key]

    known = [d for d in devices if value(d) is not None]
    unknown = [d for d in devices if value(d) is None]
    known.sort(key=lambda d: (_comparable(value(d)), str(d.get("name"))), reverse=descending)
    return known + unknown


def _comparable(value: Any) -> Any:
    return value.lower() if isinstance(value, str) else value


def _header(sort: str | None) -> str:
    key, descending = parse_sort(sort)
    cells = []
    for c in COLUMNS:
        first = f"-{c.key}" if c.descending_first else c.key
        target = (c.key if descending else f"-{c.key}") if c.key == key else first
        arrow = (" ▼" if descending else " ▲") if c.key == key else ""
        active = ' aria-sort="descending"' if c.key == key and descending else \
            ' aria-sort="ascending"' if c.key == key else ""
        cells.append(f'<th{active}><a href="?sort={target}" data-sort="{c.key}">'
                     f"{html.escape(c.title)}</a>{arrow}</th>")
    return f"<tr>{''.join(cells)}</tr>"


def _spark(history: DeviceHistory | None, what: str, span_s: float) -> str:
    if history is None:
        return ""
    span, age = (-span_s, 0.0), f"the last {_duration(span_s)}"
    if what == "battery":
        return sparkline(history.battery, BATTERY_AXIS, span, f"battery, {age}",
                         lambda v: f"{v:.0f}%")
    if what == "temp":
        return sparkline(history.temp, None, span, f"°C, {age}", lambda v: f"{v:.1f}")
    return sparkline(history.rate, None, span, f"samples/s, {age}", lambda v: f"{v:,.0f}",
                     zero=True)


def _duration(seconds: float) -> str:
    return "hour" if seconds == 3600 else f"{seconds / 60:g} minutes"


def _quarantined(d: dict[str, Any]) -> str:
    """A mark on a phone an audit quarantined (its reason on hover)."""
    why = d.get("quarantine_reason")
    return f' <b style="color:#dc2626" title="{_e(why)}">quarantined</b>' if why else ""


def _device_row(d: dict[str, Any], held: int, hot_c: float,
                history: DeviceHistory | None, span_s: float) -> str:
    tel = d.get("latest_telemetry") or {}
    battery = tel.get("battery_pct")
    rate = history.latest_rate if history else None
    return (f'<tr data-device="{_e(d.get("id"))}"><td>{_e(d.get("name"))}</td>'
            f"<td>{_state(d.get('state'))}{_quarantined(d)}</td><td>{_e(d.get('pause_reason'))}</td>"
            f'<td class="num">{_temp(d, hot_c)}{_spark(history, "temp", span_s)}</td>'
            f'<td class="num">{_e(None if battery is None else f"{battery:.0f}%")}'
            f"{' ⚡' if tel.get('charging') else ''}{_spark(history, 'battery', span_s)}</td>"
            f'<td class="num">{_e(None if rate is None else f"{rate:,.0f}")}'
            f"{_spark(history, 'rate', span_s)}</td>"
            f"<td>{held}</td><td>{_e(_labels(d))}</td>"
            f"<td>{_e(d.get('agent_version'))}</td>"
            f"<td>{_e(d.get('compute_class'))}</td></tr>")


def fleet(devices: Sequence[dict[str, Any]], jobs: Sequence[dict[str, Any]],
          refresh_s: int = 5, hot_c: float = 45.0, sort: str | None = None,
          history: dict[str, DeviceHistory] | None = None, span_s: float = 3600.0) -> str:
    """The fleet in `sort`'s order (the hottest phone first by default; each column's title
    sorts by it), with each phone's last `span_s` seconds where `history` has it; and the
    jobs, newest first, each linking to its page."""
    held = shards_held(jobs)
    history = history or {}
    rows = [_device_row(d, held.get(str(d.get("id")), 0), hot_c, history.get(str(d.get("id"))),
                        span_s) for d in sort_devices(devices, sort, held, history)]
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
    drawn = f" · sparklines: the last {_duration(span_s)}" if history else ""
    body = (f"<h1>Phalanx</h1><nav>{ready} of {len(devices)} phones Ready · "
            f"{sum(1 for j in jobs if j.get('state') == JobState.RUNNING)} job(s) running · refreshes "
            f'every {refresh_s} s{drawn} · <a href="/ui/logout">log out</a></nav>'
            f"<h2>Fleet</h2><table class=\"list fleet\">{_header(sort)}{''.join(rows)}</table>"
            f"<h2>Jobs</h2><table class=\"list jobs\"><tr><th>job</th><th>state</th>"
            f"<th>step</th><th>loss</th><th>val acc</th><th>phones</th><th>reason</th></tr>"
            f"{''.join(job_rows)}</table>")
    return page("Phalanx fleet", body, refresh_s)


def shards_held(jobs: Sequence[dict[str, Any]]) -> dict[str, int]:
    """device id -> the shards it holds, over every job."""
    held: dict[str, int] = {}
    for job in jobs:
        for device, shards in (job.get("shards") or {}).items():
            held[device] = held.get(device, 0) + len(shards)
    return held


def login(message: str = "") -> str:
    note = f'<p class="hot">{html.escape(message)}</p>' if message else ""
    body = (f"<h1>Phalanx</h1>{note}<form class=\"login\" method=\"post\" action=\"/ui/login\">"
            f"<p>An admin or user token (<code>phalanx tokens create</code>):</p>"
            f'<p><input type="password" name="token" autocomplete="current-password" '
            f'autofocus> <button type="submit">Open</button></p></form>')
    return page("Phalanx: log in", body)
