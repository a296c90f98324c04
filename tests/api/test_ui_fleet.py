"""/ui's fleet page: sorted by any column through ?sort= links, each phone's last hour as
sparklines (battery, temperature, samples a second) from the stored telemetry and the jobs'
steps, read in bounded queries (at most 60 points a phone)."""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from api.routes import ui
from domain.store.models import Event, Job, StepMetric
from tests.api.conftest import Api, api_on, sample


def rows(page: str) -> list[str]:
    return re.findall(r'<tr data-device="([^"]+)">', page)


def log_in(api) -> None:
    assert api.client.post("/ui/login", data={"token": api.user_token("ops")},
                           follow_redirects=False).status_code == 303


def heartbeats(api, device, minutes: list[float], **values) -> None:
    now = api.clock.now.timestamp()
    body = {"telemetry": [sample(now - 60 * m, **{k: v(m) if callable(v) else v
                                                  for k, v in values.items()})
                          for m in sorted(minutes, reverse=True)]}
    got = api.heartbeat(device, body)
    assert got.status_code == 200, got.text


@pytest.fixture
def api_sqlite(sqlite_url: str, tmp_path: Path) -> Iterator[Api]:
    """Sorting is Python's, not the database's: one database is enough."""
    with api_on(sqlite_url, tmp_path) as started:
        yield started


def test_each_column_sorts_the_fleet_both_ways_and_the_hottest_comes_first(api_sqlite) -> None:
    api = api_sqlite
    phones = {name: api.register(name) for name in ("b-cool", "a-hot", "c-flat")}
    heartbeats(api, phones["b-cool"], [0.1], cpu_temp_c=31.0, battery_pct=90.0)
    heartbeats(api, phones["a-hot"], [0.1], cpu_temp_c=47.5, battery_pct=15.0)
    heartbeats(api, phones["c-flat"], [0.1], cpu_temp_c=38.0, battery_pct=50.0)
    ids = {name: p["device_id"] for name, p in phones.items()}
    log_in(api)
    order = {sort: [next(n for n, i in ids.items() if i == d)
                    for d in rows(api.client.get("/ui", params={"sort": sort} if sort else {}).text)]
             for sort in ("", "-temp", "temp", "battery", "-battery", "name", "-name", "nope")}
    assert order[""] == order["-temp"] == order["nope"] == ["a-hot", "c-flat", "b-cool"]
    assert order["temp"] == ["b-cool", "c-flat", "a-hot"]
    assert order["battery"] == ["a-hot", "c-flat", "b-cool"] == order["-battery"][::-1]
    assert order["name"] == ["a-hot", "b-cool", "c-flat"] == order["-name"][::-1]
    page = api.client.get("/ui", params={"sort": "battery"}).text
    # the active column's link turns it around; another column's starts at its biggest
    assert 'href="?sort=-battery" data-sort="battery"' in page
    assert 'href="?sort=-temp" data-sort="temp"' in page and 'href="?sort=name"' in page
    assert 'aria-sort="ascending"' in page


def test_sparklines_draw_each_phones_last_hour_in_at_most_60_points(api, monkeypatch) -> None:
    a, b = api.register("phone-a"), api.register("phone-b")
    # every 20 s for 70 minutes (3 s off the buckets' edges): the ten before the hour not drawn
    minutes = [m / 3 + 0.05 for m in range(0, 210)]
    heartbeats(api, a, minutes, battery_pct=lambda m: 100 - m, cpu_temp_c=lambda m: 30 + m / 10)
    heartbeats(api, b, [1, 2], cpu_temp_c=25.0, battery_pct=None)
    now = api.clock.now
    with api.app.state.session_factory() as session:
        job = Job(name="j", spec={}, state="Running", total_steps=600)
        session.add(job)
        session.flush()
        session.add(Event(job_id=job.id, reason="Scheduled", ts=now - dt.timedelta(minutes=40),
                          data={"step": 0, "counts": {a["device_id"]: 3, b["device_id"]: 1}}))
        session.add(Event(job_id=job.id, reason="ShardsMoved", ts=now - dt.timedelta(minutes=5),
                          data={"step": 350, "counts": {b["device_id"]: 4}}))
        # one step of 256 samples every 6 s for 40 minutes: 42.7 samples/s
        for step in range(400):
            session.add(StepMetric(job_id=job.id, step=step, samples=256,
                                   ts=now - dt.timedelta(seconds=2397 - 6 * step)))
        session.commit()
    log_in(api)
    page = api.client.get("/ui", params={"sort": "-rate"}).text
    assert rows(page) == [b["device_id"], a["device_id"]]
    sparks = re.findall(r'<tr data-device="([^"]+)">|<svg class="spark" data-spark="([^"]+)" '
                        r'data-points="(\d+)"[^>]*><title>[^:]+: ([^<]+)</title>', page)
    assert [s[1:] if s[1] else s[0] for s in sparks] == [
        b["device_id"], ("°C, the last hour", "2", "25.0 to 25.0, now 25.0"),
        # phone-b holds every shard since step 350: all of the rate, a quarter before
        ("samples/s, the last hour", "40", "11 to 43, now 43"),
        a["device_id"], ("°C, the last hour", "60", "30.0 to 35.9, now 30.0"),
        ("battery, the last hour", "60", "41% to 100%, now 100%"),
        ("samples/s, the last hour", "40", "0 to 32, now 0")]  # phone-a stopped
    monkeypatch.setattr(ui, "SPARK_DEVICES", 1)  # the first phone in the page's order only
    page = api.client.get("/ui", params={"sort": "battery"}).text
    assert rows(page) == [a["device_id"], b["device_id"]]  # phone-b's battery unknown: last
    assert re.findall(r'data-spark="([^,]+),', page) == ["°C", "battery", "samples/s"]
