"""The report and the fleet page in a real headless Chromium (tests/support/browser.py): the
DOM it built (nice tick labels, a legend for every mark, a value on hover, the fleet sorted,
sparklines drawn) and what it drew (a screenshot with the curves' colours in it)."""

from __future__ import annotations

import datetime as dt
import math
import re
import subprocess
from pathlib import Path

from PIL import Image

from pictures.fleet import fleet
from pictures.history import DeviceHistory
from pictures.report import TIMELINE_MARKS, render
from tests.support.browser import Rendered, chromium, console_errors

T0 = dt.datetime(2026, 12, 7, 10, 0, tzinfo=dt.timezone.utc)


def in_browser(page: Path, tmp_path: Path, screenshot: Path | None = None) -> Rendered:
    """The DOM Chromium built and, if asked, its screenshot, from one start of it (a start
    costs seconds on a loaded machine; tests/support/browser.render starts it twice)."""
    shot = [f"--screenshot={screenshot}", "--window-size=1180,1500", "--hide-scrollbars"] \
        if screenshot else []
    done = subprocess.run([chromium(), "--headless=new", "--no-sandbox", "--disable-gpu",
                           "--disable-dev-shm-usage", "--no-first-run",
                           f"--user-data-dir={tmp_path / 'chromium-profile'}",
                           "--enable-logging=stderr", "--v=0", "--dump-dom", *shot,
                           page.resolve().as_uri()], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert screenshot is None or screenshot.exists(), done.stderr[-2000:]
    return Rendered(done.stdout, done.stderr)


def demo_like_job() -> tuple[dict, list[dict], list[dict]]:
    """100 steps of a job like the demo's, validated every 10 steps, with an event of every
    kind of mark: placed, a phone lost, shards moved, a phone too hot, one joining."""
    metrics = []
    for s in range(100):
        loss = 2.3 * math.exp(-s / 15) + 0.0109
        due = (s + 1) % 10 == 0
        metrics.append({"step": s, "ts": (T0 + dt.timedelta(seconds=0.3 * s)).isoformat(),
                        "train_loss": loss, "train_accuracy": 1 - 0.9 * math.exp(-s / 12),
                        "val_loss": loss * 1.1 if due else None,
                        "val_accuracy": 1 - 0.92 * math.exp(-s / 12) if due else None,
                        "step_seconds": 0.3, "samples": 256, "energy_j": 1.7})
    events = [
        {"reason": "Scheduled", "kind": "Normal", "message": "placed",
         "data": {"step": 0, "counts": {"a": 6, "b": 5, "c": 5}}},
        {"reason": "NodeNotReady", "kind": "Warning", "device_id": "b", "message": "lost",
         "data": {"step": 41}},
        {"reason": "ShardsMoved", "kind": "Normal", "message": "moved",
         "data": {"step": 42, "counts": {"a": 8, "c": 8}}},
        {"reason": "Paused", "kind": "Warning", "device_id": "c", "message": "too hot",
         "data": {"step": 66}},
        {"reason": "DeviceJoined", "kind": "Normal", "device_id": "a", "message": "joined",
         "data": {"step": 70}},
    ]
    job = {"id": "job-1", "name": "digits-cnn", "state": "Succeeded", "step": 100,
           "total_steps": 100, "spec": {"model": {"arch": "cnn"}, "dataset": "digits"},
           "metrics": {"train_loss": 0.025984847386877497, "val_accuracy": 0.9860724233983287,
                       "val_loss": 0.0478}}
    return job, metrics, events


def is_nice_axis(labels: list[str]) -> bool:
    """Evenly spaced multiples of 1, 2 or 5 times a power of ten."""
    values = [float(v.replace(",", "").rstrip("%")) for v in labels]
    steps = {round(b - a, 9) for a, b in zip(values, values[1:])}
    if len(steps) != 1 or min(steps) <= 0:
        return False
    step = steps.pop()
    mantissa = step / 10 ** math.floor(math.log10(step) + 1e-9)
    return any(math.isclose(mantissa, m) for m in (1, 2, 5)) and all(
        math.isclose(v / step, round(v / step), abs_tol=1e-6) for v in values)


def test_the_report_reads_in_a_browser(tmp_path: Path) -> None:
    page = tmp_path / "report.html"
    page.write_text(render(*demo_like_job(), names={"a": "phone-1", "b": "phone-2",
                                                    "c": "phone-3"}))
    shown = in_browser(page, tmp_path, screenshot=tmp_path / "report.png")
    assert console_errors(shown.log) == [], shown.log[-3000:]
    dom = shown.dom
    charts = re.findall(r'<svg viewBox="0 0 \d+ \d+"[^>]*aria-label="([^"]+)">(.*?)</svg>', dom)
    assert [title for title, _ in charts] == [
        "Loss", "Accuracy", "Step time", "Throughput", "Energy from the batteries (cumulative)",
        "timeline"]
    for title, svg in charts:
        for axis in ("x", "y"):
            labels = re.findall(rf'class="tick {axis}"[^>]*>([^<]+)<', svg)
            assert title == "timeline" and axis == "y" or is_nice_axis(labels), (title, labels)
    loss, accuracy = charts[0][1], charts[1][1]
    assert re.findall(r'class="tick y"[^>]*>([^<]+)<', loss) == ["0", "1", "2", "3"]
    assert re.findall(r'class="tick x"[^>]*>([^<]+)<', loss) == ["0", "20", "40", "60",
                                                                  "80", "100"]
    assert re.findall(r'class="tick y"[^>]*>([^<]+)<', accuracy)[-1] == "100%"
    # the facts rounded; the validation curve: its 10 points, dotted, in the legend
    assert "<td>train loss</td><td>0.0260</td>" in dom
    assert "<td>val accuracy</td><td>98.61%</td>" in dom
    assert 'data-series="validation" data-points="10"' in loss and loss.count('class="dot"') == 10
    for svg in (loss, accuracy):
        assert 'data-legend="train"' in svg and 'data-legend="validation"' in svg
    # a value on hover: each step's band says what the curves hold there
    assert "<title>step 49: train 0.0986, validation 0.108</title>" in loss
    assert "<title>step 49: train 98.48%, validation 98.45%</title>" in accuracy
    # every kind of mark on the timeline is drawn and explained
    marks = set(re.findall(r'data-mark="(\w+)"', dom)) | {"held"}
    legend = re.findall(r'<li data-legend="(\w+)">', dom)
    assert legend == list(TIMELINE_MARKS) and marks == set(legend)
    # the screenshot: the page as drawn, the curves' blue and the validation's red in it
    shot = Image.open(tmp_path / "report.png").convert("RGB")
    assert shot.size == (1180, 1500)
    colours = shot.getcolors(maxcolors=1 << 20)
    near = {name: sum(n for n, rgb in colours if all(abs(a - b) < 40 for a, b in zip(rgb, ref)))
            for name, ref in (("blue", (37, 99, 235)), ("red", (220, 38, 38)),
                              ("violet", (124, 58, 237)))}
    assert near["blue"] > 800 and near["red"] > 600 and near["violet"] > 80, near


def test_the_fleet_sorts_and_draws_sparklines_in_a_browser(tmp_path: Path) -> None:
    """/ui's fleet page as pictures.fleet draws it from what the API and the store give
    (tests/api/test_ui_fleet.py: the same through the server and its queries)."""
    devices, history = [], {}
    for i, (name, battery) in enumerate((("phone-low", 20.0), ("phone-high", 95.0),
                                         ("phone-mid", 60.0))):
        devices.append({"id": f"dev-{i}", "name": name, "state": "Ready",
                        "latest_telemetry": {"battery_pct": battery, "cpu_temp_c": 30.0 + i}})
        minutes = range(-40, 1, 5)
        history[f"dev-{i}"] = DeviceHistory(
            battery=[(60.0 * m, battery - m / 10) for m in minutes],
            temp=[(60.0 * m, 30.0 + i - m / 5) for m in minutes],
            rate=[(60.0 * m, 40.0 + i) for m in minutes])
    (tmp_path / "fleet.html").write_text(fleet(devices, [], sort="-battery", history=history))
    shown = in_browser(tmp_path / "fleet.html", tmp_path)
    assert console_errors(shown.log) == [], shown.log[-3000:]
    names = re.findall(r'<tr data-device="[^"]+"><td>([^<]+)</td>', shown.dom)
    assert names == ["phone-high", "phone-mid", "phone-low"]
    assert re.search(r'<th aria-sort="descending"><a href="\?sort=battery" data-sort="battery">',
                     shown.dom)
    sparks = re.findall(r'<svg class="spark" data-spark="([^"]+)" data-points="(\d+)"',
                        shown.dom)
    assert sorted(sparks) == sorted([("battery, the last hour", "9"), ("°C, the last hour", "9"),
                                     ("samples/s, the last hour", "9")] * 3)
    assert "<title>battery, the last hour: 95% to 99%, now 95%</title>" in shown.dom
