"""A job as one self-contained HTML page: its curves and a timeline of its phones, as pictures.

`render(job, metrics, events)` takes what the API answers (`GET /v1/jobs/{id}`, its `/metrics`
and `/events`) and returns the page: inline SVG drawn here, no script, no stylesheet or font
from anywhere else, so it opens offline and can be mailed. Charts: loss and accuracy (train and
validation), step time, samples per second, energy; the timeline draws one lane per phone with
the number of shards it held from step to step (from the Scheduled / ShardsMoved events'
`counts`) and the job's events (pauses, moves, stragglers, joins, faults) as marks on it.
"""

from __future__ import annotations

import datetime as dt
import html
import math
from bisect import bisect_left
from collections.abc import Sequence
from typing import Any

from pictures.chart import PAD_L, PAD_R, PAD_T, WIDTH, line_chart
from pictures.numbers import metric
from pictures.ticks import nice_ticks
from wire.states import JobState

_SHOWN_METRICS = (("train_loss", "train loss"), ("train_accuracy", "train accuracy"),
                  ("val_loss", "val loss"), ("val_accuracy", "val accuracy"))
EVENT_COLORS = {"Warning": "#dc2626", "Normal": "#7c3aed"}
# what each mark of the timeline means, in the order the legend lists them
TIMELINE_MARKS = {
    "held": "shards a phone held (the number: how many), from step to step",
    "Warning": "a Warning on a phone: a fault, a pause, a straggler, a lost lease",
    "Normal": "a Normal event on a phone: placed, shards moved, joined, resumed",
    "job": "an event of the whole job (no one phone), dashed across every lane: red a Warning",
}
__all__ = ["event_steps", "holdings", "line_chart", "render", "timeline", "TIMELINE_MARKS"]


def _num(value: Any) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    return float(value) if ok and math.isfinite(value) else None


def _series(metrics: Sequence[dict[str, Any]], key: str) -> list[tuple[float, float]]:
    return [(float(m["step"]), v) for m in metrics if (v := _num(m.get(key))) is not None]


def _validation(job: dict[str, Any], metrics: Sequence[dict[str, Any]], key: str
                ) -> list[tuple[float, float]]:
    """The validation points the curve holds (every `eval_every` steps), and a finished job's
    validation of its final weights at its last step (the step that made them)."""
    points = _series(metrics, key)
    final, last = _num((job.get("metrics") or {}).get(key)), int(job.get("total_steps") or 0) - 1
    if job.get("state") == JobState.SUCCEEDED and final is not None and last >= 0 and \
            all(x != last for x, _ in points):
        points.append((float(last), final))
    return points


def _rate(metrics: Sequence[dict[str, Any]]) -> list[tuple[float, float]]:
    out = []
    for m in metrics:
        s, n = _num(m.get("step_seconds")), _num(m.get("samples"))
        if s and n:
            out.append((float(m["step"]), n / s))
    return out


def _energy(metrics: Sequence[dict[str, Any]]) -> list[tuple[float, float]]:
    total, out = 0.0, []
    for m in metrics:
        e = _num(m.get("energy_j"))
        if e is not None:
            total += e
            out.append((float(m["step"]), total))
    return out


def _ts(value: Any) -> dt.datetime | None:
    if not isinstance(value, str):
        return None
    try:
        return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None


def event_steps(events: Sequence[dict[str, Any]], metrics: Sequence[dict[str, Any]]
                ) -> list[tuple[float, dict[str, Any]]]:
    """Each event at its step: the one it names (`data.step`), else the first step whose
    metric was recorded at or after it."""
    stamped = [(t, float(m["step"])) for m in metrics if (t := _ts(m.get("ts"))) is not None]
    times = [t for t, _ in stamped]
    out = []
    for ev in events:
        step = _num((ev.get("data") or {}).get("step"))
        if step is None and stamped and (t := _ts(ev.get("ts"))) is not None:
            i = bisect_left(times, t)
            step = stamped[min(i, len(stamped) - 1)][1] if i < len(stamped) else stamped[-1][1]
        out.append((step if step is not None else 0.0, ev))
    return out


def holdings(events: Sequence[tuple[float, dict[str, Any]]], end: float
             ) -> dict[str, list[tuple[float, float, int]]]:
    """device -> [(from step, to step, shards held)] from the events that carry `counts`."""
    lanes: dict[str, list[tuple[float, float, int]]] = {}
    current: dict[str, tuple[float, int]] = {}
    for step, ev in sorted(events, key=lambda se: se[0]):
        counts = (ev.get("data") or {}).get("counts")
        if not isinstance(counts, dict):
            continue
        for device in set(current) | set(counts):
            n = int(counts.get(device, 0))
            if device in current and current[device][1] != n:
                since, held = current.pop(device)
                if step > since:
                    lanes.setdefault(device, []).append((since, step, held))
            if n and device not in current:
                current[device] = (step, n)
    for device, (since, held) in current.items():
        lanes.setdefault(device, []).append((since, max(end, since + 1), held))
    return lanes


def timeline(events: Sequence[dict[str, Any]], metrics: Sequence[dict[str, Any]],
             total_steps: int, names: dict[str, str] | None = None) -> str:
    """One lane per phone: the shards it held from step to step, the job's events on it, and
    a legend for every kind of mark drawn."""
    placed = event_steps(events, metrics)
    end = float(max(total_steps, max((float(m["step"]) for m in metrics), default=0) + 1, 1))
    lanes = holdings(placed, end)
    devices = sorted(set(lanes) | {str(ev["device_id"]) for _, ev in placed
                                   if ev.get("device_id")})
    lane_h, w = 26, WIDTH * 2 - PAD_L - PAD_R
    height = PAD_T + lane_h * len(devices) + 40  # the axis: its ticks and "step" under it
    axis = nice_ticks(0, end, zero=True, integer=True)

    def px(step: float) -> float:
        return PAD_L + 90 + step / axis.hi * (w - 90)

    out = [f'<figure class="timeline"><figcaption>Which phone held how many shards, step by '
           f'step, with the job\'s events</figcaption><svg viewBox="0 0 {WIDTH * 2} {height}" '
           f'width="{WIDTH * 2}" height="{height}" role="img" aria-label="timeline">']
    drawn = {"held"} if any(lanes.values()) else set()
    for i, device in enumerate(devices):
        y = PAD_T + lane_h * i
        label = (names or {}).get(device, device)
        out.append(f'<text x="{PAD_L + 84}" y="{y + 17}" text-anchor="end" class="lane">'
                   f'{html.escape(label[:22])}</text>')
        for since, until, held in lanes.get(device, []):
            out.append(f'<rect data-device="{html.escape(device)}" x="{px(since):.1f}" '
                       f'y="{y + 4}" width="{max(px(until) - px(since), 1):.1f}" height="18" '
                       f'class="held"><title>{held} shard(s), steps {since:.0f}-{until:.0f}'
                       f'</title></rect><text x="{px(since) + 3:.1f}" y="{y + 17}" '
                       f'class="count">{held}</text>')
    axis_y = PAD_T + lane_h * len(devices)
    for t in axis.values:
        out.append(f'<text class="tick x" x="{px(t):.1f}" y="{axis_y + 16}" '
                   f'text-anchor="middle">{axis.label(t)}</text>')
    out.append(f'<text x="{px(axis.hi / 2):.1f}" y="{axis_y + 32}" text-anchor="middle">step'
               f'</text>')
    for step, ev in placed:
        out.append(_event_mark(step, ev, devices, px, lane_h, axis_y))
        drawn.add(_mark_kind(ev, devices))
    out.append("</svg>")
    out.append(_legend([k for k in TIMELINE_MARKS if k in drawn]))
    out.append("</figure>")
    return "".join(out)


def _mark_kind(ev: dict[str, Any], devices: Sequence[str]) -> str:
    if str(ev.get("device_id")) not in devices:
        return "job"
    return "Warning" if ev.get("kind") == "Warning" else "Normal"


def _event_mark(step: float, ev: dict[str, Any], devices: Sequence[str], px: Any,
                lane_h: int, axis_y: int) -> str:
    """An event as a vertical line: on its phone's lane, or dashed across all of them."""
    color = EVENT_COLORS["Warning" if ev.get("kind") == "Warning" else "Normal"]
    kind = _mark_kind(ev, devices)
    device = str(ev.get("device_id"))
    top = PAD_T + lane_h * devices.index(device) if kind != "job" else PAD_T
    bottom = top + lane_h if kind != "job" else axis_y
    dashes = ' stroke-dasharray="4 3"' if kind == "job" else ""
    reason = html.escape(str(ev.get("reason")))
    return (f'<line data-event="{reason}" data-mark="{kind}" x1="{px(step):.1f}" '
            f'x2="{px(step):.1f}" y1="{top}" y2="{bottom}" stroke="{color}" stroke-width="2"'
            f'{dashes}><title>step {step:.0f}: {reason} — '
            f'{html.escape(str(ev.get("message", "")))}</title></line>')


def _legend(kinds: Sequence[str]) -> str:
    """The timeline's legend: a swatch of each kind of mark drawn and what it means."""
    swatches = {
        "held": '<rect x="1" y="1" width="20" height="10" class="held"/>',
        "Warning": f'<line x1="11" x2="11" y1="0" y2="12" stroke="{EVENT_COLORS["Warning"]}" '
                   f'stroke-width="2"/>',
        "Normal": f'<line x1="11" x2="11" y1="0" y2="12" stroke="{EVENT_COLORS["Normal"]}" '
                  f'stroke-width="2"/>',
        "job": '<line x1="11" x2="11" y1="0" y2="12" stroke="#555" stroke-width="2" '
               'stroke-dasharray="4 3"/>',
    }
    items = "".join(f'<li data-legend="{k}"><svg width="22" height="12" aria-hidden="true">'
                    f'{swatches[k]}</svg> {html.escape(TIMELINE_MARKS[k])}</li>' for k in kinds)
    return f'<ul class="legend">{items}</ul>' if items else ""


STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #111; }
h1 { font-size: 20px; margin: 0 0 4px; } .facts td { padding: 2px 12px 2px 0; }
.charts { display: flex; flex-wrap: wrap; gap: 12px; } figure { margin: 8px 0; }
figcaption { font-weight: 600; margin-bottom: 4px; } svg text { font-size: 11px; fill: #333; }
.plot { fill: #fafafa; stroke: #ddd; } .grid { stroke: #eee; }
.held { fill: #bfdbfe; stroke: #2563eb; } .count { font-size: 10px; fill: #1e3a8a; }
table.events td { padding: 1px 10px 1px 0; vertical-align: top; } .Warning { color: #dc2626; }
ul.legend { list-style: none; padding: 0; margin: 4px 0 0; font-size: 12px; color: #333; }
ul.legend li { display: inline-block; margin-right: 16px; } ul.legend svg { vertical-align: -1px; }
.hover { fill: transparent; } .hover:hover { fill: rgba(37, 99, 235, 0.08); }
"""


def _compute_class(job: dict[str, Any]) -> str | None:
    """A `class` job's compute class, and whether the server is of it (so whether `phalanx
    train --local` there gives the job's bits); None for a portable job."""
    if (job.get("exactness") or (job.get("spec") or {}).get("exactness")) != "class":
        return None
    fingerprint = job.get("compute_class")
    if not fingerprint:
        return "not chosen yet (at its first placement)"
    same = job.get("server_is_reference")
    where = {True: "the server's own: phalanx train --local there is its reference",
             False: "not the server's: phalanx train --local there is not its reference"}
    return f"#{fingerprint}" + (f" ({where[same]})" if same in where else "")


def _quarantined(events: Sequence[dict[str, Any]], names: dict[str, str]) -> str | None:
    """The phones audits caught lying in this job (its ResultMismatch events), and when."""
    caught = {}
    for e in events:
        if e.get("reason") == "ResultMismatch" and e.get("device_id"):
            device = str(e["device_id"])
            caught.setdefault(names.get(device, device), (e.get("data") or {}).get("step"))
    return ", ".join(f"{name} (step {step})" for name, step in sorted(caught.items())) or None


def render(job: dict[str, Any], metrics: Sequence[dict[str, Any]],
           events: Sequence[dict[str, Any]], names: dict[str, str] | None = None,
           refresh_s: int | None = None) -> str:
    """The whole page for `job`; `names`: device id -> a name to show instead; `refresh_s`:
    the page reloads itself that often (the server's live view of a running job)."""
    m = job.get("metrics") or {}
    spec = job.get("spec") or {}
    facts = [("state", job.get("state")), ("steps", f"{job.get('step')}/{job.get('total_steps')}"),
             ("model", (spec.get("model") or {}).get("arch")), ("dataset", spec.get("dataset")),
             *((label, metric(key, m.get(key))) for key, label in _SHOWN_METRICS),
             ("parameters", (job.get("plan") or {}).get("parameters")),
             ("exactness", job.get("exactness") or spec.get("exactness")),
             ("compute class", _compute_class(job)),
             ("quarantined", _quarantined(events, names or {})),
             ("reason", job.get("reason"))]
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(str(v))}</td></tr>"
                   for k, v in facts if v is not None)
    marked = ("validation",)
    charts = [
        line_chart("Loss", {"train": _series(metrics, "train_loss"),
                            "validation": _validation(job, metrics, "val_loss")}, marked=marked),
        line_chart("Accuracy", {"train": _series(metrics, "train_accuracy"),
                                "validation": _validation(job, metrics, "val_accuracy")},
                   as_percent=True, marked=marked),
        line_chart("Step time", {"seconds": _series(metrics, "step_seconds")}, "s"),
        line_chart("Throughput", {"samples/s": _rate(metrics)}),
        line_chart("Energy from the batteries (cumulative)", {"joules": _energy(metrics)}, "J"),
    ]
    event_rows = "".join(
        f'<tr class="{html.escape(str(e.get("kind")))}"><td>{html.escape(str(e.get("ts", "")))}'
        f'</td><td>{html.escape(str(e.get("reason")))}</td><td>'
        f'{html.escape(str(e.get("message", "")))}</td></tr>' for e in events)
    title = html.escape(f"{job.get('name')} ({job.get('id')})")
    refresh = f'<meta http-equiv="refresh" content="{refresh_s}">' if refresh_s else ""
    return (f"<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">{refresh}"
            f"<title>{title}</title><style>{STYLE}</style></head><body>"
            f"<h1>{title}</h1><table class=\"facts\">{rows}</table>"
            f"<div class=\"charts\">{''.join(charts)}</div>"
            f"{timeline(events, metrics, int(job.get('total_steps') or 0), names)}"
            f"<h2>Events</h2><table class=\"events\">{event_rows}</table></body></html>")

