"""The control plane serves the agent to phones: /install.sh and /agent.tar.gz need no token,
the archive pip-installs into a clean target and runs, and install.sh outside a checkout falls
back to SERVER/agent.tar.gz."""

from __future__ import annotations

import hashlib
import io
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import httpx

from api.agent_dist import build_archive
from tests.agent.helpers import REPO, fake_termux


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
    for name in ("agent/cli.py", "agent/install.sh", "engine/step.py", "wire/messages.py"):
        assert f"phalanx-agent-0.1.0/{name}" in names
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
    # the engine and the wire format the agent runs come from the archive too
    where = subprocess.run(
        [sys.executable, "-c", "import agent.runtime.worker, engine.step, wire.messages; "
         "print(engine.step.__file__); print(wire.messages.__file__)"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert where.returncode == 0, where.stderr
    assert all(line.startswith(str(target)) for line in where.stdout.split()), where.stdout


def test_the_archive_is_the_same_bytes_for_the_same_sources(tmp_path: Path) -> None:
    roots = {}
    for name in ("agent", "engine", "wire"):
        roots[name] = tmp_path / name
        shutil.copytree(REPO / name, roots[name], ignore=shutil.ignore_patterns("__pycache__"))
    root = roots["agent"]
    first = build_archive(roots, "9.9.9")
    (root / "__pycache__").mkdir(exist_ok=True)
    (root / "__pycache__" / "x.pyc").write_bytes(b"junk")
    assert build_archive(roots, "9.9.9") == first
    step = roots["engine"] / "step.py"
    step.write_text(step.read_text() + "\n# changed\n")
    assert build_archive(roots, "9.9.9") != first


def test_install_sh_away_from_a_checkout_installs_from_the_server(tmp_path: Path) -> None:
    env, calls = fake_termux(tmp_path)
    script = tmp_path / "downloaded" / "install.sh"  # as `curl SERVER/install.sh | bash` has it
    script.parent.mkdir()
    shutil.copy(REPO / "agent" / "install.sh", script)
    out = subprocess.run(["bash", str(script), "--server", "http://10.0.0.2:8000", "--token", "t"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "pip install --no-deps --upgrade http://10.0.0.2:8000/agent.tar.gz" in calls.read_text()


def test_pip_install_of_the_agent_folder_brings_the_engine_and_the_wire_format(
        tmp_path: Path) -> None:
    """`pip install ./agent` in a checkout (install.sh's local source) maps its sibling
    folders `engine` and `wire` into the same install."""
    checkout = tmp_path / "checkout"
    for name in ("agent", "engine", "wire"):
        shutil.copytree(REPO / name, checkout / name, ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "--quiet", "--target", str(target), "./agent"],
        capture_output=True, text=True, timeout=300, cwd=checkout)
    assert done.returncode == 0, done.stderr
    assert {"agent", "engine", "wire"} <= {p.name for p in target.iterdir()}
    assert (target / "engine" / "step.py").is_file() and (target / "wire" / "messages.py").is_file()


def test_install_sh_installs_only_the_archive_whose_sha256_was_pinned(tmp_path: Path) -> None:
    env, calls = fake_termux(tmp_path)
    served = tmp_path / "served.tar.gz"
    served.write_bytes(b"the agent archive as served")
    curl = tmp_path / "bin" / "curl"  # downloads `served`, whatever the URL: the network's copy
    curl.write_text(f'#!/bin/sh\necho "curl $*" >> "{calls}"\n'
                    f'while [ $# -gt 0 ]; do [ "$1" = -o ] && cp "{served}" "$2"; shift; done\n')
    curl.chmod(0o755)
    env["TMPDIR"] = str(tmp_path)
    script = tmp_path / "downloaded" / "install.sh"
    script.parent.mkdir()
    shutil.copy(REPO / "agent" / "install.sh", script)
    pin = hashlib.sha256(served.read_bytes()).hexdigest()
    args = ["bash", str(script), "--server", "http://10.0.0.2:8000", "--token", "t", "--sha256"]
    good = subprocess.run([*args, pin], env=env, capture_output=True, text=True, timeout=60)
    assert good.returncode == 0, good.stderr
    log = calls.read_text()
    assert "curl -fsSL http://10.0.0.2:8000/agent.tar.gz -o" in log
    assert f"pip install --no-deps --upgrade {tmp_path}/phalanx-agent-" in log  # the checked file
    calls.write_text("")
    served.write_bytes(b"something else, swapped on the way")
    bad = subprocess.run([*args, pin], env=env, capture_output=True, text=True, timeout=60)
    assert bad.returncode == 3 and f"does not have sha256 {pin}" in bad.stderr
    assert "pip install" not in calls.read_text()
    assert not list(tmp_path.glob("phalanx-agent-*.tar.gz"))  # nothing left behind


def test_install_sh_trusts_the_labs_own_certificate_for_every_download_and_the_agent(
        tmp_path: Path) -> None:
    env, calls = fake_termux(tmp_path)
    served = tmp_path / "served.tar.gz"
    served.write_bytes(b"archive")
    curl = tmp_path / "bin" / "curl"
    curl.write_text(f'#!/bin/sh\necho "curl $*" >> "{calls}"\n'
                    f'while [ $# -gt 0 ]; do [ "$1" = -o ] && cp "{served}" "$2"; shift; done\n')
    curl.chmod(0o755)
    env["TMPDIR"] = str(tmp_path)
    (tmp_path / "server.pem").write_text("the lab's certificate")
    script = tmp_path / "downloaded" / "install.sh"
    script.parent.mkdir()
    shutil.copy(REPO / "agent" / "install.sh", script)
    pin = hashlib.sha256(served.read_bytes()).hexdigest()
    done = subprocess.run(["bash", str(script), "--server", "https://10.0.0.2:8000", "--token",
                           "t", "--sha256", pin, "--ca-file", "server.pem"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    log = calls.read_text()
    pem = f"{tmp_path}/server.pem"
    assert f"curl -fsSL --cacert {pem} https://10.0.0.2:8000/agent.tar.gz" in log
    assert "phalanx-agent enroll --server https://10.0.0.2:8000 --token t" in log
    assert f"--ca-file {pem}" in log.split("phalanx-agent enroll", 1)[1]
