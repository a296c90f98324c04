"""deploy/termux/install.sh in a fake Termux: the right packages, pip flags, service and boot files."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.agent.helpers import REPO, fake_termux

SCRIPT = REPO / "deploy" / "termux" / "install.sh"

def test_install_sh_sets_up_packages_agent_service_and_boot(tmp_path: Path) -> None:
    env, calls = fake_termux(tmp_path)
    out = subprocess.run(["bash", str(SCRIPT), "--server", "http://10.0.0.2:8000", "--token",
                          "enr-abc", "--label", "rack=a", "--source", "/src/agent", "--torch"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    log = calls.read_text().splitlines()
    assert log[0] == "pkg install -y python python-numpy termux-api termux-services"
    assert "pkg install -y python-torch" in log
    assert "pip install --no-deps --upgrade /src/agent" in log
    home, prefix = Path(env["HOME"]), Path(env["PREFIX"])
    config = home / ".config/phalanx-agent/config.json"
    assert (f"phalanx-agent enroll --server http://10.0.0.2:8000 --token enr-abc --config "
            f"{config} --label rack=a") in log
    assert "sv-enable phalanx-agent" in log and "termux-wake-lock" in log
    agent_home = home / ".local/share/phalanx-agent"
    assert f"phalanx-agent install-launcher --home {agent_home}" in log
    run = prefix / "var/service/phalanx-agent/run"
    assert f'exec sh "{agent_home}/launch.sh" run --config "{config}"' in run.read_text()
    assert f'PHALANX_AGENT_HOME="{agent_home}"' in run.read_text()  # upgrades need it
    for script in (run, run.with_name("finish"), run.parent / "log" / "run",
                   home / ".termux/boot/phalanx-agent"):
        assert os.access(script, os.X_OK), script
        assert script.read_text().startswith("#!")
    assert "start-services.sh" in (home / ".termux/boot/phalanx-agent").read_text()


def test_install_sh_refuses_to_run_outside_termux(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PREFIX": str(tmp_path / "nope")}
    out = subprocess.run(["bash", str(SCRIPT), "--server", "http://x", "--token", "t"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "inside Termux" in out.stderr


def test_the_finish_script_keeps_a_revoked_agent_down(tmp_path: Path) -> None:
    env, calls = fake_termux(tmp_path)
    subprocess.run(["bash", str(SCRIPT), "--no-enroll", "--source", "/src/agent"], env=env,
                   check=True, capture_output=True, timeout=60)
    finish = Path(env["PREFIX"]) / "var/service/phalanx-agent/finish"
    out = subprocess.run(["sh", str(finish), "3", "0"], env=env, cwd=finish.parent,
                         capture_output=True, text=True, timeout=30)
    assert "revoked" in out.stdout
    assert f"sv down {finish.parent}" in calls.read_text()
