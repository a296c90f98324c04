"""The heartbeat: lease, telemetry, pause and capabilities; refusals; node lifecycle."""

from __future__ import annotations

import datetime as dt
import math
import sqlite3
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import psycopg
import pytest

from api.limits import DeviceRate
from domain.store.db import libpq_url
from domain.store.devices import prune_telemetry
from domain.store.lifecycle import mark_stale_devices
from domain.store.models import Device, Event, TelemetrySample
from tests.api.conftest import sample


def test_heartbeat_stores_what_the_agent_reports(api):
    device = api.register()
    body = {"telemetry": [sample(1000.0), sample(1010.0, cpu_temp_c=47.5, throttled=True)],
            "agent_version": "0.1.0",
            "capabilities": {"backends": ["numpy"], "archs": ["cnn"]},
            "profiles": {"cnn": {"samples_per_s": 812.0, "threads": 4}},
            "pause": {"reason": "thermal", "detail": "cpu 47.5 C > max_temp_c 45"}}
    resp = api.heartbeat(device, body)
    assert resp.status_code == 200
    reply = resp.json()
    assert reply["device_id"] == device["device_id"] and reply["state"] == "Ready"
    assert reply["lease"]["grace_s"] == 40.0 and reply["heartbeat_interval_s"] == 10.0
    shown = api.get(f"/v1/devices/{device['device_id']}").json()
    assert shown["agent_version"] == "0.1.0" and shown["pause_reason"] == "thermal"
    assert shown["capabilities"]["archs"] == ["cnn"]
    assert shown["profiles"]["cnn"]["samples_per_s"] == 812.0
    assert shown["latest_telemetry"]["cpu_temp_c"] == 47.5
    assert api.count(TelemetrySample) == 2
    # absent fields keep what was stored; an absent pause means the agent trains again
    api.heartbeat(device, {"telemetry": []})
    shown = api.get(f"/v1/devices/{device['device_id']}").json()
    assert shown["pause_reason"] is None and shown["agent_version"] == "0.1.0"
    reasons = [e["reason"] for e in api.get(f"/v1/devices/{device['device_id']}/events").json()["items"]]
    assert reasons == ["Registered", "Paused", "Resumed"]


def test_iso_timestamps_are_accepted(api):
    device = api.register()
    resp = api.heartbeat(device, {"telemetry": [{"ts": "2026-01-02T03:04:05Z", "busy": True}]})
    assert resp.status_code == 200
    history = api.get(f"/v1/devices/{device['device_id']}/telemetry").json()["items"]
    assert history[0]["ts"].startswith("2026-01-02T03:04:05") and history[0]["busy"] is True


@pytest.mark.parametrize("body, field", [
    ({}, "telemetry"),
    ({"telemetry": {}}, "telemetry"),
    ({"telemetry": [{"battery_pct": 5}]}, "telemetry.0.ts"),
    ({"telemetry": [{"ts": "noon"}]}, "telemetry.0.ts"),
    ({"telemetry": [{"ts": 1.0, "battery_pct": 140}]}, "telemetry.0.battery_pct"),
    ({"telemetry": [{"ts": 1.0, "battery_pct": "full"}]}, "telemetry.0.battery_pct"),
    ({"telemetry": [{"ts": 1.0, "humidity": 3}]}, "telemetry.0.humidity"),
    ({"telemetry": [], "pause": {"detail": "x"}}, "pause.reason"),
    ({"telemetry": [], "colour": "red"}, "colour"),
    ({"telemetry": [{"ts": float(i)} for i in range(1001)]}, "telemetry"),
])
def test_malformed_heartbeats_are_422_and_change_nothing(api, body, field):
    device = api.register()
    before = api.get(f"/v1/devices/{device['device_id']}").json()
    resp = api.heartbeat(device, body)
    assert resp.status_code == 422, resp.text
    assert field in [err["field"] for err in resp.json()["detail"]]
    assert api.get(f"/v1/devices/{device['device_id']}").json() == before
    assert api.count(TelemetrySample) == 0


def test_non_json_and_oversized_heartbeats_are_refused(api):
    device = api.register()
    path, headers = f"/v1/devices/{device['device_id']}/heartbeat", {
        "Authorization": f"Bearer {device['device_token']}", "content-type": "application/json"}
    bad = api.client.post(path, content=b'{"telemetry": [', headers=headers)
    assert bad.status_code == 422 and "JSON" in bad.json()["detail"][0]["msg"]
    huge = b'{"telemetry": [], "agent_version": "' + b"x" * (2 * 1024 * 1024) + b'"}'
    too_big = api.client.post(path, content=huge, headers=headers)
    assert too_big.status_code == 413 and "limit" in too_big.json()["detail"]
    chunked = api.client.post(path, content=iter([huge[:600_000], huge[600_000:]]), headers=headers)
    assert chunked.status_code == 413
    assert api.count(TelemetrySample) == 0


def test_lease_expiry_marks_not_ready_and_the_next_heartbeat_restores_it(api):
    fresh, stale = api.register("fresh"), api.register("stale")
    api.clock.advance(30)
    api.heartbeat(fresh)
    api.clock.advance(15)  # stale: 45 s since its lease, fresh: 15 s
    with api.app.state.session_factory() as session, session.begin():
        assert mark_stale_devices(session, api.clock(), 40.0) == [stale["device_id"]]
    with api.app.state.session_factory() as session, session.begin():
        assert mark_stale_devices(session, api.clock(), 40.0) == []  # twice equals once
    assert api.get(f"/v1/devices/{stale['device_id']}").json()["state"] == "NotReady"
    assert api.get("/v1/devices?state=NotReady").json()["items"][0]["name"] == "stale"
    assert api.heartbeat(stale).json()["state"] == "Ready"
    assert api.get(f"/v1/devices/{stale['device_id']}").json()["state"] == "Ready"
    events = api.get(f"/v1/devices/{stale['device_id']}/events").json()["items"]
    assert [e["reason"] for e in events] == ["Registered", "NodeNotReady", "NodeReady"]


def test_a_cordoned_device_comes_back_cordoned(api):
    device = api.register()
    api.post(f"/v1/devices/{device['device_id']}/cordon")
    api.clock.advance(41)
    with api.app.state.session_factory() as session, session.begin():
        mark_stale_devices(session, api.clock(), 40.0)
    assert api.get(f"/v1/devices/{device['device_id']}").json()["state"] == "NotReady"
    assert api.heartbeat(device).json()["state"] == "Cordoned"


def test_device_changes_reach_the_scheduler(api):
    seen: list[str] = []

    class Hooks:
        def job_changed(self, job_id):
            pass

        def device_changed(self, device_id):
            seen.append(device_id)

    api.app.state.scheduler = Hooks()
    device = api.register()
    api.post(f"/v1/devices/{device['device_id']}/cordon")
    api.heartbeat(device, {"telemetry": [], "pause": {"reason": "busy"}})
    api.heartbeat(device, {"telemetry": [], "pause": {"reason": "busy"}})  # no change
    assert seen == [device["device_id"]] * 3


def test_profile_is_requested_for_an_active_job_arch(api):
    device = api.register()
    api.post("/v1/jobs", json={"name": "j", "model": {"arch": "mlp"}, "dataset": "digits"})
    api.app.state.heartbeats._archs = (0.0, set())  # forget the cached set of active archs
    assert api.heartbeat(device).json()["commands"] == [{"type": "profile", "arch": "mlp"}]
    reply = api.heartbeat(device, {"telemetry": [], "profiles": {"mlp": {"samples_per_s": 9.0}}})
    assert reply.json()["commands"] == []


def test_many_concurrent_heartbeats_lose_no_sample(api):
    devices = [api.register(f"p{i}") for i in range(8)]
    per_device, samples = 25, 3
    # 25 at once from each phone: past the per-device rate, which is not what this is about
    api.app.state.heartbeat_rate = DeviceRate(per_minute=60.0, burst=per_device, clock=time.time)

    def beat(args):
        device, i = args
        body = {"telemetry": [sample(1000.0 + i * 10 + k, battery_pct=float(k)) for k in range(samples)]}
        return api.heartbeat(device, body).status_code

    jobs = [(d, i) for d in devices for i in range(per_device)]
    with ThreadPoolExecutor(max_workers=16) as pool:
        codes = list(pool.map(beat, jobs))
    assert codes == [200] * len(jobs)
    assert api.count(TelemetrySample) == len(jobs) * samples
    for device in devices:
        history = api.get(f"/v1/devices/{device['device_id']}/telemetry").json()["items"]
        assert len(history) == per_device * samples


@contextmanager
def writes_blocked(url: str) -> Iterator[None]:
    """Another connection holds the tables heartbeats write to, as a slow commit would."""
    if url.startswith("sqlite"):
        conn = sqlite3.connect(url.removeprefix("sqlite:///"), isolation_level=None)
        conn.execute("BEGIN EXCLUSIVE")
        try:
            yield
        finally:
            conn.rollback()
            conn.close()
        return
    with psycopg.connect(libpq_url(url)) as conn:
        conn.execute("LOCK TABLE devices, telemetry_samples IN EXCLUSIVE MODE")
        yield
        conn.rollback()


def waiting(writer: object) -> int:
    """Heartbeats queued behind the commit in flight (SQLite's writer thread, or the Postgres
    writer's pending list)."""
    queued = getattr(writer, "_queue", None)
    return queued.qsize() if queued is not None else len(writer._pending)  # type: ignore[attr-defined]


def test_heartbeats_that_arrive_during_a_commit_share_the_next_one(api):
    devices = [api.register(f"g{i}") for i in range(12)]
    writer = api.app.state.heartbeats
    with ThreadPoolExecutor(max_workers=12) as pool:
        with writes_blocked(api.settings.resolved_database_url):
            before = writer.batches
            replies = [pool.submit(api.heartbeat, d, {"telemetry": [sample(5000.0)]})
                       for d in devices]
            deadline = time.monotonic() + 60
            while waiting(writer) < 6 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert waiting(writer) >= 6, "heartbeats did not queue behind the blocked commit"
        assert [r.result().status_code for r in replies] == [200] * 12
    # the six or more that waited were committed together: fewer transactions than heartbeats
    assert writer.batches - before <= 12 - 6 + 2
    assert api.count(TelemetrySample) == 12


def test_prune_telemetry_drops_old_history_but_keeps_the_latest_on_the_device(api):
    device = api.register()
    api.heartbeat(device, {"telemetry": [{"ts": 100.0, "power_w": 1.0}, {"ts": 300.0, "power_w": 3.0}]})
    cutoff = dt.datetime.fromtimestamp(200.0, dt.timezone.utc)
    with api.app.state.session_factory() as session, session.begin():
        assert prune_telemetry(session, cutoff) == 1
    history = api.get(f"/v1/devices/{device['device_id']}/telemetry").json()["items"]
    assert [s["power_w"] for s in history] == [3.0]
    assert api.get(f"/v1/devices/{device['device_id']}").json()["latest_telemetry"]["power_w"] == 3.0
    assert api.count(Device) == 1 and api.count(Event) == 1



def test_the_server_does_not_trust_a_phone_clock_set_in_the_future(api):
    device = api.register("clock")
    now = api.clock().timestamp()
    for future in ("9999-12-31T23:59:59Z", now + 86400):
        resp = api.heartbeat(device, {"telemetry": [sample(now - 5), {"ts": future}]})
        assert resp.status_code == 422, resp.text
        [error] = resp.json()["detail"]
        assert error["loc"][-3:] == ["telemetry", "1", "ts"]
        assert "ahead of the server's clock" in error["msg"]
    assert api.count(TelemetrySample) == 0  # nothing of the refused heartbeat is stored
    assert api.heartbeat(device, {"telemetry": [sample(now + 60)]}).status_code == 200  # skew ok


def test_the_latest_sample_only_moves_forward(api):
    """ts=0 (a clock reset to 1970) is stored in the history, but the device keeps showing its
    newest sample, whichever order they arrive in."""
    device = api.register("order")
    now = api.clock().timestamp()
    assert api.heartbeat(device, {"telemetry": [sample(now - 10, battery_pct=55.0)]}).status_code == 200
    assert api.heartbeat(device, {"telemetry": [sample(0.0, battery_pct=1.0)]}).status_code == 200
    shown = api.get(f"/v1/devices/{device['device_id']}").json()
    assert shown["latest_telemetry"]["battery_pct"] == 55.0
    assert shown["latest_telemetry_at"].startswith(
        dt.datetime.fromtimestamp(now - 10, dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S"))
    assert api.count(TelemetrySample) == 2


def test_a_phone_past_its_heartbeat_rate_gets_429_and_strangers_cannot_use_up_its_rate(api):
    phone, other = api.register("fast"), api.register("other")
    burst, per_minute = api.settings.heartbeat_burst, api.settings.heartbeat_rate_per_minute
    for _ in range(burst):
        assert api.heartbeat(phone).status_code == 200
    refused = api.heartbeat(phone)
    assert refused.status_code == 429 and "faster than" in refused.json()["detail"]
    assert int(refused.headers["Retry-After"]) == math.ceil(60 / per_minute)
    assert api.heartbeat(other).status_code == 200  # one phone's rate, not the fleet's
    api.clock.advance(60 / per_minute)  # one more has been earned
    assert api.heartbeat(phone).status_code == 200
    assert api.heartbeat(phone).status_code == 429
    api.clock.advance(3600)
    # heartbeats naming the phone with another token are refused and cost the phone nothing
    for token in ("phx-dev-" + "x" * 43, other["device_token"]):
        for _ in range(burst + 5):
            stranger = api.post(f"/v1/devices/{phone['device_id']}/heartbeat", token=token,
                                json={"telemetry": []})
            assert stranger.status_code in (401, 403)
    assert all(api.heartbeat(phone).status_code == 200 for _ in range(burst))


def test_an_old_device_token_is_rotated_on_the_heartbeats_word_and_then_ends(api):
    phone = api.register("old")
    device_id, first = phone["device_id"], phone["device_token"]
    commands = api.heartbeat(phone).json()["commands"]
    assert {"type": "rotate_token"} not in commands
    api.clock.advance(api.settings.device_token_max_age_s + 1)
    assert {"type": "rotate_token"} in api.heartbeat(phone).json()["commands"]
    rotated = api.post(f"/v1/devices/{device_id}/token", token=first, json={})
    assert rotated.status_code == 200, rotated.text
    second = rotated.json()["device_token"]
    assert second != first and second.startswith("phx-dev-")
    # the old token works for the grace period (requests in flight), and is not asked to
    # rotate again: a superseded token never rotates (a 409 if it tries)
    assert {"type": "rotate_token"} not in api.heartbeat(phone).json()["commands"]
    new = {"device_id": device_id, "device_token": second}
    assert {"type": "rotate_token"} not in api.heartbeat(new).json()["commands"]
    api.clock.advance(api.settings.device_token_rotation_grace_s + 1)
    refused = api.heartbeat(phone)
    assert refused.status_code == 401 and "expired" in refused.json()["detail"]
    assert api.heartbeat(new).status_code == 200
    # a device rotates only its own token; a user token cannot
    other = api.register("other")
    assert api.post(f"/v1/devices/{device_id}/token", token=other["device_token"],
                    json={}).status_code == 403
    assert api.post(f"/v1/devices/{device_id}/token", token=api.user_token(),
                    json={}).status_code == 403
