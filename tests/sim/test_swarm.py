"""The swarm (`phalanx sim --mode swarm`): its raw HTTP/1.1 client speaks the real enrollment
and heartbeat formats to a real server, and a phone behaves as the agent does when the server
fails (the samples kept and sent later, backoff, a 401 stops it)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
from typer.testing import CliRunner

from phalanx.cli.main import app
from phalanx.sim.rawhttp import TransportError, parse_response
from phalanx.sim.swarm import Swarm, SwarmOptions, run_swarm
from phalanx.sim.swarm_stats import LatencyHistogram
from tests.support.databases import migrated_sqlite
from tests.support.env import ADMIN_TOKEN
from tests.support.server import LiveServer, start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    base = tmp_path_factory.mktemp("swarm")
    srv = start_server(database_url=migrated_sqlite(base / "db.sqlite"), data_dir=base / "data",
                       admin_token=ADMIN_TOKEN, extra_env={"PHALANX_HEARTBEAT_INTERVAL_S": "1"})
    yield srv
    srv.stop()


def test_200_phones_enroll_and_beat_twice_over_shared_connections(server: LiveServer) -> None:
    report = run_swarm(SwarmOptions(server=server.url, phones=200, duration_s=60, beats=2,
                                    admin_token=ADMIN_TOKEN, connections=16))
    assert report["errors"] == 0, (report["errors_by_kind"], report["refusals"])
    assert report["phones_enrolled"] == 200
    assert report["endpoints"]["register"]["statuses"] == {"201": 200}
    beats = report["endpoints"]["heartbeat"]
    assert beats["statuses"] == {"200": beats["requests"]} and beats["requests"] >= 400
    assert report["states"] == {"Ready": beats["requests"]}  # every answer said Ready
    assert report["interval_s"] == 1.0  # the server's, from the enrollment answer
    assert 0 < beats["latency_ms"]["p50"] <= beats["latency_ms"]["p99"] <= beats["latency_ms"]["max"]
    assert report["cleanup_errors"] == 0, report["cleanup_failures"]
    with server.client() as admin:
        assert admin.get("/v1/devices").json()["items"] == []


def test_the_server_stores_what_a_swarm_phone_sends(server: LiveServer) -> None:
    report = run_swarm(SwarmOptions(server=server.url, phones=3, duration_s=30, beats=1,
                                    admin_token=ADMIN_TOKEN, connections=2, cleanup=False,
                                    work_every_s=0.2, labels={"rack": "r1"}))
    assert report["errors"] == 0, report["errors_by_kind"]
    with server.client() as admin:
        devices = admin.get("/v1/devices", params={"selector": "rack=r1"}).json()["items"]
        assert len(devices) == 3
        for device in devices:
            assert device["state"] == "Ready"
            assert device["spec"]["cpu_cores"] >= 1  # the simulated profile's hardware spec
            assert {"numpy"} == set(device["capabilities"]["backends"])
            assert "portable" in device["capabilities"]["features"]
            latest = device["latest_telemetry"]
            assert 0 < latest["battery_pct"] <= 100 and latest["cpu_temp_c"] > 20
            assert admin.delete(f"/v1/devices/{device['id']}").status_code == 200


def test_phalanx_sim_picks_the_swarm_above_1000_phones_or_when_asked(
        server: LiveServer) -> None:
    result = CliRunner().invoke(app, [
        "sim", "--mode", "swarm", "--phones", "20", "--server", server.url, "--token",
        ADMIN_TOKEN, "--duration", "2", "--concurrency", "4", "-o", "json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout[result.stdout.index("{"):])
    assert report["mode"] == "swarm" and report["phones_enrolled"] == 20
    assert report["endpoints"]["heartbeat"]["requests"] >= 20


# -- a phone when the server fails, against a scripted server -------------------------------

async def scripted_server(answers: list[tuple[int, dict[str, Any]]],
                          seen: list[tuple[str, dict[str, Any]]]) -> asyncio.AbstractServer:
    """Answers each request with the next (status, body); registrations always succeed."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await answer(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the phone closed its connection
        writer.close()

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while head := await reader.readuntil(b"\r\n\r\n"):
            lines = head.decode().split("\r\n")
            length = next((int(v) for k, _, v in (h.partition(": ") for h in lines[1:])
                           if k.lower() == "content-length"), 0)
            body = json.loads(await reader.readexactly(length)) if length else {}
            path = lines[0].split(" ")[1]
            seen.append((path, body))
            if path.endswith("/register"):
                status, reply = 201, {"device_id": "dev-1", "device_token": "phx-dev-x",
                                      "heartbeat_interval_s": 0.05}
            else:
                status, reply = answers.pop(0) if answers else (200, {"state": "Ready"})
            raw = json.dumps(reply).encode()
            writer.write(b"HTTP/1.1 %d X\r\ncontent-length: %d\r\n\r\n%s" % (status, len(raw), raw))
            await writer.drain()

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def test_a_phone_keeps_its_samples_through_failures_and_stops_on_401() -> None:
    seen: list[tuple[str, dict[str, Any]]] = []

    async def main() -> dict[str, Any]:
        answers = [(503, {}), (429, {}), (200, {"state": "Ready", "commands": [{"type": "logs"}]}),
                   (401, {"detail": "revoked"})]
        srv = await scripted_server(answers, seen)
        port = srv.sockets[0].getsockname()[1]
        swarm = Swarm(SwarmOptions(server=f"http://127.0.0.1:{port}", phones=1, duration_s=20,
                                   enroll_token="phx-enr-x", connections=1, cleanup=False))
        swarm._backoff = lambda failures, base, cap: 0.01  # type: ignore[method-assign]
        report = await swarm.run()
        srv.close()
        return report

    report = asyncio.run(main())
    beats = [body for path, body in seen if path.endswith("/heartbeat")]
    # one new sample each attempt, every unsent one sent again, oldest first, with what the agent sends
    assert [len(b["telemetry"]) for b in beats] == [1, 2, 3, 1]
    assert beats[2]["telemetry"][0]["ts"] < beats[2]["telemetry"][2]["ts"]
    assert set(beats[0]) == {"telemetry", "agent_version", "capabilities", "profiles", "pause"}
    assert report["endpoints"]["heartbeat"]["statuses"] == {"503": 1, "429": 1, "200": 1, "401": 1}
    assert report["phones_stopped"] == 1 and report["commands"] == {"logs": 1}
    assert report["refusals"]["heartbeat: 401"] == '{"detail": "revoked"}'


def test_responses_are_read_by_length_or_chunks_and_only_when_complete() -> None:
    ok = bytearray(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\n{}HTTP/1.1 204")
    resp, end = parse_response(ok) or (None, 0)
    assert resp == (200, b"{}", True) and ok[end:] == b"HTTP/1.1 204"
    assert parse_response(bytearray(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n{}")) is None
    chunked = bytearray(b"HTTP/1.1 503 X\r\nTransfer-Encoding: chunked\r\nConnection: close"
                        b"\r\n\r\n2\r\n{\"\r\n3\r\na\"}\r\n0\r\n\r\n")
    resp, end = parse_response(chunked) or (None, 0)
    assert resp == (503, b'{"a"}', False) and end == len(chunked)
    assert parse_response(chunked[:-2]) is None
    with pytest.raises(TransportError, match="malformed"):
        parse_response(bytearray(b"SSH-2.0-OpenSSH\r\n\r\n"))


def test_latency_percentiles_are_within_a_bucket_of_the_truth() -> None:
    hist = LatencyHistogram()
    for ms in range(1, 1001):  # 1..1000 ms
        hist.add(ms / 1000)
    assert hist.percentile(0.5) == pytest.approx(0.5, rel=0.03)
    assert hist.percentile(0.99) == pytest.approx(0.99, rel=0.03)
    assert hist.percentile(1.0) == 1.0 and hist.n == 1000
    assert LatencyHistogram().summary_ms() == {}


def test_the_swarm_speaks_http_only() -> None:
    with pytest.raises(SystemExit, match="plain http"):
        Swarm(SwarmOptions(server="https://example.test", phones=1))
