"""examples/sdk_tour.py (the SDK's notebook-style tour) runs as written against a live server."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.cli.conftest import Cli
from tests.support.server import REPO_ROOT


def test_the_sdk_tour_runs_against_a_live_server(cli: Cli, register_device) -> None:
    register_device("tour-phone", {"rack": "tour"})
    env = {**os.environ, "PHALANX_SERVER": cli.server.url, "PHALANX_TOKEN": cli.server.admin_token}
    done = subprocess.run([sys.executable, str(REPO_ROOT / "examples" / "sdk_tour.py"),
                           "--no-wait"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "tour-phone" in out and "digits" in out
    assert "parameters" in out and "MiB per phone" in out and "device(s) could run it now" in out
    assert "submitted job-" in out and "cancelled: Cancelled" in out
