"""Agent builds side by side (agent/slots.py) and launch.sh, run as runit runs it: an upgrade
starts the new build on trial, a heartbeat keeps it, a build that never gets that far is rolled
back after three starts, and an archive that is not exactly the pinned build is refused."""

from __future__ import annotations

import hashlib
import io
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from agent.slots import NotNow, Slots, UpgradeError
from tests.agent.builds import agent_tree, archive
from tests.agent.helpers import REPO
from tests.support.env import without_settings


def install_launcher(home: Path) -> Path:
    out = subprocess.run([sys.executable, "-m", "agent", "install-launcher", "--home", str(home)],
                         cwd=REPO, env=without_settings() | {"PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert Path(out.stdout.strip()) == home / "launch.sh"
    return home / "launch.sh"


def launch(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """One start of launch.sh, as runit's run script makes it."""
    env = without_settings() | {"PHALANX_AGENT_HOME": str(home),
                                "PHALANX_AGENT_PYTHON": sys.executable}
    env.pop("PYTHONPATH", None)
    return subprocess.run(["sh", str(home / "launch.sh"), *args], env=env, cwd="/",
                          capture_output=True, text=True, timeout=60)


def build(tmp_path: Path, version: str, broken: bool = False) -> tuple[bytes, str]:
    data = archive(agent_tree(tmp_path / f"src-{version}", version, broken=broken), version)
    return data, hashlib.sha256(data).hexdigest()


def test_an_upgrade_runs_on_trial_is_kept_and_a_broken_one_is_rolled_back(
        tmp_path: Path) -> None:
    home = tmp_path / "home"
    install_launcher(home)
    slots = Slots(home)
    assert launch(home, "--version").stdout.strip() == "0.1.0"  # no slot: the installed agent

    good, good_sha = build(tmp_path, "0.2.0")
    slot = slots.install(good, good_sha, "0.2.0")
    assert slot == f"0.2.0-{good_sha[:8]}" and slots.in_trial
    assert launch(home, "--version").stdout.strip() == "0.2.0"
    assert not slots.confirm("0.1.0")  # an agent of another build cannot end the trial
    assert slots.confirm("0.2.0") and not slots.in_trial

    broken, broken_sha = build(tmp_path, "0.3.0", broken=True)
    slots.install(broken, broken_sha, "0.3.0")
    for _ in range(3):
        out = launch(home, "--version")
        assert out.returncode != 0 and "cannot start" in out.stderr
    back = launch(home, "--version")
    assert back.returncode == 0 and back.stdout.strip() == "0.2.0", back.stderr
    assert "did not reach the server in 3 starts" in back.stderr
    assert slots.current == slot and not slots.in_trial
    assert slots.rolled_back() == f"0.3.0-{broken_sha[:8]}"  # until the server has it
    slots.reported()
    assert slots.rolled_back() is None
    assert launch(home, "--version").stdout.strip() == "0.2.0"
    install_launcher(home)  # reinstalling with install.sh: the installed agent runs again
    assert launch(home, "--version").stdout.strip() == "0.1.0" and slots.current == ""


def test_an_archive_that_is_not_the_pinned_build_is_refused(tmp_path: Path) -> None:
    home = tmp_path / "home"
    slots = Slots(home)
    data, sha = build(tmp_path, "0.2.0")
    with pytest.raises(NotNow, match="not the"):  # another replica's build: asked again
        slots.install(data, "0" * 64, "0.2.0")
    with pytest.raises(UpgradeError, match="holds agent 0.2.0, not 0.2.1"):
        slots.install(data, sha, "0.2.1")
    assert slots.current == ""  # nothing half-installed is ever started
    assert [p.name for p in (home / "slots").iterdir()] == []


@pytest.mark.parametrize("name, kind", [("top/agent/../../evil.py", tarfile.REGTYPE),
                                        ("top/agent/link", tarfile.SYMTYPE)])
def test_an_archive_reaching_outside_its_folder_is_refused(tmp_path: Path, name: str,
                                                           kind: bytes) -> None:
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w:gz") as tar:
        info = tarfile.TarInfo(name)
        info.type, info.linkname = kind, "/etc/passwd"
        tar.addfile(info, io.BytesIO(b""))
    data = raw.getvalue()
    with pytest.raises(UpgradeError):
        Slots(tmp_path / "home").install(data, hashlib.sha256(data).hexdigest(), "0.2.0")
    assert not (tmp_path / "evil.py").exists() and not (tmp_path / "home" / "evil.py").exists()
