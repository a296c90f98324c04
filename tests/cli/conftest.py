"""Run `phalanx ...` in-process (typer's CliRunner) against a live `phalanx server`.

One server per test module (`shared_server`): starting one costs seconds, and these tests
only add objects they find again by id, so they do not see each other.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import Result
from typer.testing import CliRunner

from phalanx.cli.main import app
from tests.support.databases import migrated_sqlite
from tests.support.env import ADMIN_TOKEN
from tests.support.server import LiveServer, start_server


@dataclass
class Cli:
    server: LiveServer
    config: Path

    def __call__(self, *args: str, token: str | None = "admin", server: str | None = "live",
                 env: dict[str, str] | None = None, input: str | None = None) -> Result:
        """`phalanx *args`; token/server "admin"/"live" mean the live server's, None means unset."""
        full_env = {"PHALANX_CONFIG": str(self.config), "COLUMNS": "220", "NO_COLOR": "1",
                    "PHALANX_SERVER": None, "PHALANX_TOKEN": None}
        if server is not None:
            full_env["PHALANX_SERVER"] = self.server.url if server == "live" else server
        if token is not None:
            full_env["PHALANX_TOKEN"] = self.server.admin_token if token == "admin" else token
        full_env.update(env or {})
        return CliRunner().invoke(app, list(args), env=full_env, input=input)

    def json(self, *args: str, **kwargs: Any) -> Any:
        result = self(*args, "-o", "json", **kwargs)
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)


@pytest.fixture(scope="module")
def shared_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """`phalanx server` in embedded mode for every test of one module."""
    base = tmp_path_factory.mktemp("cli-server")
    server = start_server(database_url=migrated_sqlite(base / "phalanx.sqlite"),
                          data_dir=base / "data", admin_token=ADMIN_TOKEN)
    yield server
    server.stop()


@pytest.fixture
def cli(shared_server: LiveServer, tmp_path: Path) -> Cli:
    return Cli(shared_server, tmp_path / "cli" / "config.json")


def one_line_error(result: Result, code: int = 1) -> str:
    """A failed command: exit `code`, nothing on stdout, exactly one line on stderr."""
    assert result.exit_code == code, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


@pytest.fixture
def register_device(shared_server: LiveServer) -> Callable[..., dict[str, Any]]:
    """Enroll a device directly over the API (what the agent does); returns the reply."""

    def register(name: str = "phone-1", labels: dict[str, str] | None = None) -> dict[str, Any]:
        with shared_server.client() as admin:
            resp = admin.post("/v1/enrollment-tokens", json={"labels": {"rack": "a"}})
            assert resp.status_code == 201, resp.text
            body = {"enrollment_token": resp.json()["token"], "name": name,
                    "labels": labels or {}, "spec": {"model": "SM-G975U", "cpu_cores": 8}}
            reply = httpx.post(f"{shared_server.url}/v1/devices/register", json=body, timeout=30)
            assert reply.status_code == 201, reply.text
            return reply.json()

    return register
