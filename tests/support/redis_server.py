"""Redis as docker-compose.yml runs it (its command and environment: no persistence, the
allocator keeping freed pages), started on a port of a test's own: the fault tests stop and
restart it, and tests/deploy/test_compose_redis.py checks what that command does."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import IO

import pytest
import yaml

from tests.support.server import REPO_ROOT


def compose_redis() -> tuple[list[str], dict[str, str]]:
    """The compose file's Redis command and environment."""
    service = yaml.safe_load((REPO_ROOT / "docker-compose.yml").read_text())["services"]["redis"]
    return service["command"], {name: str(value)
                                for name, value in (service.get("environment") or {}).items()}


def start_compose_redis(port: int, data_dir: Path,
                        log: IO[bytes] | int = subprocess.DEVNULL) -> subprocess.Popen[bytes]:
    """This machine's redis-server run with the compose file's command and environment, on
    127.0.0.1:`port`, its files (none, unless it persists) in `data_dir`."""
    server = shutil.which("redis-server")
    if server is None:
        pytest.fail("redis-server is not installed (Debian: apt-get install redis-server): the "
                    "test runs the compose file's Redis command with it")
    command, environment = compose_redis()
    assert command[0] == "redis-server", command
    data_dir.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(
        [server, *command[1:], "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data_dir)],
        env={**os.environ, **environment}, cwd=data_dir, stdout=log, stderr=subprocess.STDOUT)


def stop(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM (Redis saves on the way out only if told to persist), then SIGKILL."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)
