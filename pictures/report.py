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
from bisect import bisect_left
from collections.abc import Sequence
from typing import Any

WIDTH, HEIGHT, PAD_L, PAD_R, PAD_T, PAD_B = 560, 220, 56, 16, 24, 36
COLORS = ("#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c")
EVENT_COLORS = {"Warning": "#dc2626", "Normal": "#2563eb"}


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) \
        else None


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        return [lo]
    step = (hi - lo) / (n - 1)
    return [lo + i * step for i in range(n)]


def _fmt(v: float) -> str:
    a = abs(v)
    if a >= 1e6 or (0 < a < 1e-3):
        return f"{v:.2e}"
    return f"{v:,.0f}" if a >= 100 else f"{v:.3g}"


def line_chart(title: str, series: dict[str, list[tuple[float, float]]], unit: str = "") -> str:
    """An SVG line chart; each series is a polyline with `data-series` and one point per value."""
    drawn = {k: v for k, v in series.items() if v}
    if not drawn:
        return f'<figure class="chart"><figcaption>{html.escape(title)}</figcaption>' \
               f'<p class="empty">no data</p></figure>'
    xs = [x for pts in drawn.values() for x, _ in pts]
    ys = [y for pts in drawn.values() for _, y in pts]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    y0, y1 = min(ys), max(ys)
    if y1 <= y0:
        y0, y1 = y0 - 0.5, y1 + 0.5
    w, h = WIDTH - PAD_L - PAD_R, HEIGHT - PAD_T - PAD_B

    def px(x: float) -> float:
        return PAD_L + (x - x0) / (x1 - x0) * w

    def py(y: float) -> float:
        return PAD_T + h - (y - y0) / (y1 - y0) * h

    out = [f'<figure class="chart"><figcaption>{html.escape(title)}</figcaption>',
           f'<svg viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" '
           f'role="img" aria-label="{html.escape(title)}">',
           f'<rect x="{PAD_L}" y="{PAD_T}" width="{w}" height="{h}" class="plot"/>']
    for t in _ticks(y0, y1):
        out.append(f'<line x1="{PAD_L}" x2="{PAD_L + w}" y1="{py(t):.1f}" y2="{py(t):.1f}" '
                   f'class="grid"/><text x="{PAD_L - 4}" y="{py(t) + 4:.1f}" '
                   f'text-anchor="end">{_fmt(t)}</text>')
    for t in _ticks(x0, x1):
        out.append(f'<text x="{px(t):.1f}" y="{PAD_T + h + 16}" text-anchor="middle">'
                   f'{t:.0f}</text>')
    out.append(f'<text x="{PAD_L + w / 2}" y="{HEIGHT - 4}" text-anchor="middle">step</text>')
    for i, (name, pts) in enumerate(drawn.items()):
        color = COLORS[i % len(COLORS)]
        points = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        out.append(f'<polyline data-series="{html.escape(name)}" data-points="{len(pts)}" '
                   f'points="{points}" fill="none" stroke="{color}" stroke-width="1.6"/>')
        out.append(f'<text x="{PAD_L + 8 + 130 * i}" y="{PAD_T - 8}" fill="{color}">'
                   f'■ {html.escape(name)}{(" (" + unit + ")") if unit else ""}</text>')
    out.append("</svg></figure>")
    return "".join(out)


def _series(metrics: Sequence[dict[str, Any]], key: str) -> list[tuple[float, float]]:
    return [(float(m["step"]), v) for m in metrics if (v := _num(m.get(key))) is not None]


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
    """One lane per phone: the shards it held from step to step, the job's events on it."""
    placed = event_steps(events, metrics)
    end = float(max(total_steps, max((float(m["step"]) for m in metrics), default=0) + 1, 1))
    lanes = holdings(placed, end)
    devices = sorted(set(lanes) | {str(ev["device_id"]) for _, ev in placed
                                   if ev.get("device_id")})
    lane_h, w = 26, WIDTH * 2 - PAD_L - PAD_R
    height = PAD_T + lane_h * (len(devices) + 1) + PAD_B

    def px(step: float) -> float:
        return PAD_L + 90 + step / end * (w - 90)

    out = [f'<figure class="timeline"><figcaption>Which phone held how many shards, step by '
           f'step, with the job\'s events</figcaption><svg viewBox="0 0 {WIDTH * 2} {height}" '
           f'width="{WIDTH * 2}" height="{height}" role="img" aria-label="timeline">']
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
    for t in _ticks(0, end):
        out.append(f'<text x="{px(t):.1f}" y="{axis_y + 16}" text-anchor="middle">{t:.0f}</text>')
    for step, ev in placed:
        color = EVENT_COLORS.get(str(ev.get("kind")), "#2563eb")
        device = ev.get("device_id")
        top = PAD_T + lane_h * devices.index(str(device)) if device in devices else PAD_T
        bottom = top + lane_h if device in devices else axis_y
        out.append(f'<line data-event="{html.escape(str(ev.get("reason")))}" x1="{px(step):.1f}" '
                   f'x2="{px(step):.1f}" y1="{top}" y2="{bottom}" stroke="{color}" '
                   f'stroke-width="2"><title>step {step:.0f}: {html.escape(str(ev.get("reason")))}'
                   f' — {html.escape(str(ev.get("message", "")))}</title></line>')
    out.append("</svg></figure>")
    return "".join(out)


STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; margin: 24px; color: #111; }
h1 { font-size: 20px; margin: 0 0 4px; } .facts td { padding: 2px 12px 2px 0; }
.charts { display: flex; flex-wrap: wrap; gap: 12px; } figure { margin: 8px 0; }
figcaption { font-weight: 600; margin-bottom: 4px; } svg text { font-size: 11px; fill: #333; }
.plot { fill: #fafafa; stroke: #ddd; } .grid { stroke: #eee; }
.held { fill: #bfdbfe; stroke: #2563eb; } .count { font-size: 10px; fill: #1e3a8a; }
table.events td { padding: 1px 10px 1px 0; vertical-align: top; } .Warning { color: #dc2626; }
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


def render(job: dict[str, Any], metrics: Sequence[dict[str, Any]],
           events: Sequence[dict[str, Any]], names: dict[str, str] | None = None,
           refresh_s: int | None = None) -> str:
    """The whole page for `job`; `names`: device id -> a name to show instead; `refresh_s`:
    the page reloads itself that often (the server's live view of a running job)."""
    m = job.get("metrics") or {}
    spec = job.get("spec") or {}
    facts = [("state", job.get("state")), ("steps", f"{job.get('step')}/{job.get('total_steps')}"),
             ("model", (spec.get("model") or {}).get("arch")), ("dataset", spec.get("dataset")),
             ("train loss", m.get("train_loss")), ("val accuracy", m.get("val_accuracy")),
             ("parameters", (job.get("plan") or {}).get("parameters")),
             ("exactness", job.get("exactness") or spec.get("exactness")),
             ("compute class", _compute_class(job)),
             ("reason", job.get("reason"))]
    rows = "".join(f"<tr><td>{html.escape(k)}</td><td>{html.escape(str(v))}</td></tr>"
                   for k, v in facts if v is not None)
    charts = [
        line_chart("Loss", {"train": _series(metrics, "train_loss"),
                            "validation": _series(metrics, "val_loss")}),
        line_chart("Accuracy", {"train": _series(metrics, "train_accuracy"),
                                "validation": _series(metrics, "val_accuracy")}),
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

