"""A phone installed from the server's archive (what the install line does) trusts that
server's release key and nothing else, with no step of its own (issue 42, item 9): the key
file is inside the archive the line's sha256 pins, and pip installs it with the agent."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import httpx

from agent import __version__, release


def test_pip_installing_the_served_archive_installs_the_servers_key(live_server,
                                                                    tmp_path: Path) -> None:
    resp = httpx.get(f"{live_server.url}/agent.tar.gz", timeout=30)
    archive = tmp_path / "agent.tar.gz"
    archive.write_bytes(resp.content)
    target = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
         "--disable-pip-version-check", "--quiet", "--target", str(target), str(archive)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    trusted = subprocess.run(
        [sys.executable, "-c", "from agent import release; "
         "print(release.packaged_key_path()); "
         "print(*[k.hex() for k in release.trusted_keys(None)])"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"})
    assert trusted.returncode == 0, trusted.stderr
    where, keys = trusted.stdout.split("\n")[:2]
    assert where.startswith(str(target))
    assert keys.split() == [resp.headers[release.KEY_HEADER]]
    assert release.check(resp.content, resp.headers[release.SIGNATURE_HEADER], __version__,
                         hashlib.sha256(resp.content).hexdigest(),
                         [bytes.fromhex(keys)])
