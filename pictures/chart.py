"""Line charts and sparklines as inline SVG: nice ticks (pictures.ticks), a legend for every
series, and each value on hover without a script (an SVG `<title>` over a band per step)."""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Sequence

from pictures.numbers import percent, significant
from pictures.ticks import Axis, nice_ticks

WIDTH, HEIGHT, PAD_L, PAD_R, PAD_T, PAD_B = 560, 220, 56, 16, 24, 36
COLORS = ("#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c")
HOVER_BANDS = 100  # hover targets per chart at most: a page that reloads every 5 s stays light

Points = Sequence[tuple[float, float]]


def finite(points: Points) -> list[tuple[float, float]]:
    return [(float(x), float(y)) for x, y in points if math.isfinite(x) and math.isfinite(y)]


def line_chart(title: str, series: dict[str, Points], unit: str = "", *,
               as_percent: bool = False, zero: bool = True, marked: Sequence[str] = ()) -> str:
    """An SVG chart of `series` over the steps: each a polyline (`data-series`, one point per
    value); a series named in `marked` (sparse, e.g. validation) also draws a dot per point.
    `as_percent`: values are fractions shown as percentages; `zero`: the value axis reaches 0."""
    drawn = {k: finite(v) for k, v in series.items() if finite(v)}
    if not drawn:
        return f'<figure class="chart"><figcaption>{html.escape(title)}</figcaption>' \
               f'<p class="empty">no data</p></figure>'
    xs = [x for pts in drawn.values() for x, _ in pts]
    ys = [y for pts in drawn.values() for _, y in pts]
    x_axis = nice_ticks(min(xs), max(xs), zero=True, integer=True)
    y_axis = nice_ticks(min(ys), max(ys), zero=zero)
    w, h = WIDTH - PAD_L - PAD_R, HEIGHT - PAD_T - PAD_B

    def px(x: float) -> float:
        return PAD_L + (x - x_axis.lo) / (x_axis.hi - x_axis.lo) * w

    def py(y: float) -> float:
        return PAD_T + h - (y - y_axis.lo) / (y_axis.hi - y_axis.lo) * h

    shown = y_axis.percent if as_percent else y_axis.label
    value = percent if as_percent else significant
    out = [f'<figure class="chart"><figcaption>{html.escape(title)}</figcaption>',
           f'<svg viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" '
           f'role="img" aria-label="{html.escape(title)}">',
           f'<rect x="{PAD_L}" y="{PAD_T}" width="{w}" height="{h}" class="plot"/>']
    for t in y_axis.values:
        out.append(f'<line x1="{PAD_L}" x2="{PAD_L + w}" y1="{py(t):.1f}" y2="{py(t):.1f}" '
                   f'class="grid"/><text class="tick y" x="{PAD_L - 4}" y="{py(t) + 4:.1f}" '
                   f'text-anchor="end">{shown(t)}</text>')
    for t in x_axis.values:
        out.append(f'<text class="tick x" x="{px(t):.1f}" y="{PAD_T + h + 16}" '
                   f'text-anchor="middle">{x_axis.label(t)}</text>')
    out.append(f'<text x="{PAD_L + w / 2}" y="{HEIGHT - 4}" text-anchor="middle">step</text>')
    out.append(_hover_bands(drawn, px, PAD_T, h, value, unit))
    for i, (name, pts) in enumerate(drawn.items()):
        color = COLORS[i % len(COLORS)]
        dot = name in marked
        points = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        dashes = ' stroke-dasharray="5 3"' if dot else ""
        out.append(f'<polyline data-series="{html.escape(name)}" data-points="{len(pts)}" '
                   f'points="{points}" fill="none" stroke="{color}" stroke-width="1.6"{dashes}/>')
        if dot:
            out.extend(f'<circle class="dot" cx="{px(x):.1f}" cy="{py(y):.1f}" r="3" '
                       f'fill="{color}"/>' for x, y in pts)
        out.append(_legend_entry(name, unit, color, dot, PAD_L + 8 + 140 * i, PAD_T - 12))
    out.append("</svg></figure>")
    return "".join(out)


def _legend_entry(name: str, unit: str, color: str, dot: bool, x: float, y: float) -> str:
    """A series' swatch (its line, dashed with a dot for a marked series) and its name."""
    dashes = ' stroke-dasharray="5 3"' if dot else ""
    mark = (f'<line x1="{x}" x2="{x + 18}" y1="{y}" y2="{y}" stroke="{color}" '
            f'stroke-width="2"{dashes}/>')
    if dot:
        mark += f'<circle cx="{x + 9}" cy="{y}" r="3" fill="{color}"/>'
    suffix = f" ({unit})" if unit else ""
    return (f'<g class="legend" data-legend="{html.escape(name)}">{mark}<text x="{x + 23}" '
            f'y="{y + 4}">{html.escape(name)}{suffix}</text></g>')


def _hover_bands(drawn: dict[str, list[tuple[float, float]]], px: Callable[[float], float],
                 top: float, height: float, value: Callable[[float], str], unit: str) -> str:
    """A transparent band over each of (at most HOVER_BANDS) steps, its `<title>` the values
    there: a browser shows it when the pointer rests on the band."""
    at: dict[float, list[str]] = {}
    for name, pts in drawn.items():
        for x, y in pts:
            at.setdefault(x, []).append(f"{name} {value(y)}{(' ' + unit) if unit else ''}")
    steps = sorted(at)
    every = max(1, math.ceil(len(steps) / HOVER_BANDS))
    chosen = steps[::every]
    edges = [px(chosen[0])] + [(px(a) + px(b)) / 2 for a, b in zip(chosen, chosen[1:])] + \
        [px(chosen[-1])]
    out = []
    for i, x in enumerate(chosen):
        left, right = max(edges[i] - (2 if i == 0 else 0), PAD_L), edges[i + 1] + (
            2 if i == len(chosen) - 1 else 0)
        out.append(f'<rect class="hover" x="{left:.1f}" y="{top}" width="{right - left:.1f}" '
                   f'height="{height}"><title>step {x:.0f}: {html.escape(", ".join(at[x]))}'
                   f'</title></rect>')
    return "".join(out)


def sparkline(points: Points, axis: Axis | None = None, span: tuple[float, float] | None = None,
              label: str = "", value: Callable[[float], str] = significant, zero: bool = False,
              width: int = 120, height: int = 24) -> str:
    """A small line of `points` (time, value) without axes, its last value as a dot; `axis`:
    the value range to draw in (a battery's 0-100), else the points' own (from 0 if `zero`);
    `span`: the times the width stands for (the last hour), else the points' own; the
    `<title>` says the range and the last value."""
    pts = finite(points)
    if not pts:
        return '<span class="spark empty">-</span>'
    ys = [y for _, y in pts]
    axis = axis or nice_ticks(min(ys), max(ys), zero=zero)
    x0, x1 = span or (pts[0][0], pts[-1][0])
    x1 = x1 if x1 > x0 else x0 + 1

    def px(x: float) -> float:
        return 1 + (x - x0) / (x1 - x0) * (width - 4)

    def py(y: float) -> float:
        return height - 2 - (y - axis.lo) / (axis.hi - axis.lo) * (height - 4)

    line = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
    told = f"{label}: {value(min(ys))} to {value(max(ys))}, now {value(ys[-1])}"
    return (f'<svg class="spark" data-spark="{html.escape(label)}" data-points="{len(pts)}" '
            f'viewBox="0 0 {width} {height}" width="{width}" height="{height}" role="img" '
            f'aria-label="{html.escape(told)}"><title>{html.escape(told)}</title>'
            f'<polyline points="{line}" fill="none" stroke="#2563eb" stroke-width="1.2"/>'
            f'<circle cx="{px(pts[-1][0]):.1f}" cy="{py(ys[-1]):.1f}" r="1.8" fill="#2563eb"/>'
            f"</svg>")
