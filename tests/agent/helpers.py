"""Running the real agent in tests: configs, threads, subprocesses, a fake Termux."""

from __future__ import annotations

import stat
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from agent.config import AgentConfig, save
from agent.probes import Probes
from agent.runtime.agent import AgentRuntime
from tests.support.env import without_settings

REPO = Path(__file__).resolve().parents[2]


def write_config(path: Path, server: str, token: str, device_id: str = "dev-1",
                 **knobs: Any) -> Path:
    knobs.setdefault("backends", ["numpy"])  # torch's import costs seconds per candidate
    save(path, AgentConfig(server=server, device_id=device_id, device_token=token, **knobs))
    return path


class AgentThread:
    """The library entry point, as the demo's simulated phones use it."""

    def __init__(self, config: Path, sysfs_root: Path, **kw: Any) -> None:
        probes = Probes(str(sysfs_root), use_psutil=False)
        self.runtime = AgentRuntime(config, probes=probes, work_wait_s=1.0, **kw)
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            self.runtime.run(self.stop)
        except BaseException as exc:  # surfaced to the test
            self.error = exc

    def __enter__(self) -> AgentThread:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=60)
        assert not self.thread.is_alive(), "agent did not stop within 60 s"


def agent_process(config: Path, sysfs_root: Path | None, log: Path,
                  extra_env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """`phalanx-agent run --config ...` as a real process (python -m agent)."""
    env = without_settings()
    env.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    if sysfs_root is not None:
        env["PHALANX_SYSFS_ROOT"] = str(sysfs_root)
    env.update(extra_env or {})
    with log.open("ab") as fh:
        return subprocess.Popen([sys.executable, "-m", "agent", "run", "--config", str(config)],
                                cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT)


FAKES = ("pkg", "pip", "sv-enable", "termux-wake-lock", "phalanx-agent", "sv")


def fake_termux(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """A Termux prefix and home, and fakes of its commands that log each call: (env, log)."""
    prefix, home, bin_dir = tmp_path / "usr", tmp_path / "home", tmp_path / "bin"
    for d in (prefix / "bin", prefix / "etc" / "profile.d", home, bin_dir):
        d.mkdir(parents=True)
    calls = tmp_path / "calls.log"
    for name in FAKES:
        exe = bin_dir / name
        exe.write_text(f'#!/bin/sh\necho "{name}${{*:+ $*}}" >> "{calls}"\n')
        exe.chmod(exe.stat().st_mode | stat.S_IXUSR)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "PREFIX": str(prefix), "HOME": str(home)}
    return env, calls
