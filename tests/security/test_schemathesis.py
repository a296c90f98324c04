"""Schemathesis against the live server's OpenAPI document: every operation, with requests
generated from its schema (valid and invalid), as admin, as a user and as a device, on both
databases. No answer may be a 5xx: bad input gets a 4xx that names the problem."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.support.env import ADMIN_TOKEN
from tests.support.server import LiveServer, start_server

SCHEMATHESIS = Path(sys.executable).parent / "schemathesis"
EXAMPLES = {"admin": 8, "user": 5, "device": 5}  # per operation and phase
# SQLite (the embedded mode) differs from Postgres below the routes only: the admin, who reaches
# every operation, fuzzes it; every kind of token fuzzes Postgres (production)
KINDS = {"sqlite_url": ("admin",), "pg_url": ("admin", "user", "device")}


@pytest.fixture(params=list(KINDS))
def server(request: pytest.FixtureRequest,
           tmp_path: Path) -> Iterator[tuple[LiveServer, tuple[str, ...]]]:
    """A live server on one database, and the kinds of token that fuzz it."""
    live = start_server(database_url=request.getfixturevalue(request.param),
                        data_dir=tmp_path / "data", admin_token=ADMIN_TOKEN)
    yield live, KINDS[request.param]
    live.stop()


def tokens(url: str) -> dict[str, str]:
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    with httpx.Client(base_url=url, timeout=30) as c:
        user = c.post("/v1/tokens", json={"name": "fuzz"}, headers=admin).json()["token"]
        enroll = c.post("/v1/enrollment-tokens", json={}, headers=admin).json()["token"]
        device = c.post("/v1/devices/register",
                        json={"enrollment_token": enroll, "name": "fuzz-phone"}).json()
    return {"admin": ADMIN_TOKEN, "user": user, "device": device["device_token"]}


def test_no_operation_answers_a_5xx_to_generated_requests(
        server: tuple[LiveServer, tuple[str, ...]], tmp_path: Path) -> None:
    assert SCHEMATHESIS.exists(), "schemathesis is in the dev extras: pip install -e '.[dev]'"
    live, kinds = server
    for kind, token in tokens(live.url).items():
        if kind not in kinds:
            continue
        run = subprocess.run(
            [str(SCHEMATHESIS), "run", f"{live.url}/openapi.json", "--checks",
             "not_a_server_error", "--header", f"Authorization: Bearer {token}",
             "--max-examples", str(EXAMPLES[kind]), "--phases", "coverage,fuzzing",
             "--seed", "1", "--no-shrink", "--wait-for-schema", "30",
             "--request-timeout", "30"],
            cwd=tmp_path, capture_output=True, text=True, timeout=600)
        out = run.stdout + run.stderr
        assert run.returncode == 0, f"as {kind}:\n{out[-6000:]}"
        assert "Tested: " in out and " passed" in out, out[-3000:]
        assert "unresolvable reference" not in out.lower(), out[-3000:]  # every part tested
    assert httpx.get(f"{live.url}/healthz", timeout=10).status_code == 200
