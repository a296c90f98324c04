"""The control plane serves the agent to phones: /install.sh and /agent.tar.gz need no token,
the archive pip-installs into a clean target and runs, and install.sh outside a checkout falls
back to SERVER/agent.tar.gz."""

from __future__ import annotations

import io
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import httpx

from api.agent_dist import build_archive
from tests.agent.helpers import REPO
from tests.agent.test_termux_install import fake_termux


def test_install_sh_and_the_agent_archive_are_served_without_a_token(live_server) -> None:
    script = httpx.get(f"{live_server.url}/install.sh", timeout=30)
    assert script.status_code == 200
    assert script.content == (REPO / "agent" / "install.sh").read_bytes()
    tarball = httpx.get(f"{live_server.url}/agent.tar.gz", timeout=30)
    assert tarball.status_code == 200 and tarball.headers["content-type"] == "application/gzip"
    again = httpx.get(f"{live_server.url}/agent.tar.gz",
                      headers={"If-None-Match": tarball.headers["etag"]}, timeout=30)
    assert again.status_code == 304
    with tarfile.open(fileobj=io.BytesIO(tarball.content)) as tar:
        names = tar.getnames()
    assert "phalanx-agent-0.1.0/pyproject.toml" in names
    assert "phalanx-agent-0.1.0/cli.py" in names and "phalanx-agent-0.1.0/nn/step.py" in names
    assert not any("__pycache__" in n or n.endswith(".pyc") for n in names)


def test_the_served_archive_pip_installs_and_runs(live_server, tmp_path: Path) -> None:
    archive = tmp_path / "agent.tar.gz"
    archive.write_bytes(httpx.get(f"{live_server.url}/agent.tar.gz", timeout=30).content)
    target = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "--quiet", "--target", str(target), str(archive)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (target / "bin" / "phalanx-agent").is_file()
    assert (target / "agent" / "install.sh").is_file()
    run = subprocess.run([sys.executable, "-m", "agent", "--help"], capture_output=True, text=True,
                         timeout=60, cwd=tmp_path, env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr
    assert "enroll" in run.stdout


def test_the_archive_is_the_same_bytes_for_the_same_sources(tmp_path: Path) -> None:
    root = tmp_path / "agent"
    shutil.copytree(REPO / "agent", root, ignore=shutil.ignore_patterns("__pycache__"))
    first = build_archive(root, "9.9.9")
    (root / "__pycache__").mkdir(exist_ok=True)
    (root / "__pycache__" / "x.pyc").write_bytes(b"junk")
    assert build_archive(root, "9.9.9") == first
    (root / "cli.py").write_text((root / "cli.py").read_text() + "\n# changed\n")
    assert build_archive(root, "9.9.9") != first


def test_install_sh_away_from_a_checkout_installs_from_the_server(tmp_path: Path) -> None:
    env, calls = fake_termux(tmp_path)
    script = tmp_path / "downloaded" / "install.sh"  # as `curl SERVER/install.sh | bash` has it
    script.parent.mkdir()
    shutil.copy(REPO / "agent" / "install.sh", script)
    out = subprocess.run(["bash", str(script), "--server", "http://10.0.0.2:8000", "--token", "t"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "pip install --no-deps --upgrade http://10.0.0.2:8000/agent.tar.gz" in calls.read_text()
