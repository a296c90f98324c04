"""Fixtures for the agent's tests: fixture phones, a fake Termux:API on PATH, a clean env."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.agent import phone


@pytest.fixture(autouse=True)
def _agent_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for var in ("PHALANX_AGENT_SLOWDOWN", "PHALANX_AGENT_SLOWDOWN_FILE", "PHALANX_SYSFS_ROOT"):
        monkeypatch.delenv(var, raising=False)
    # no real termux-battery-status or getprop from the host leaks into a test
    empty = tmp_path / "empty-bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", f"{empty}{os.pathsep}{os.environ.get('PATH', '')}")


@pytest.fixture
def rooted(tmp_path: Path) -> Path:
    return phone.build_tree(tmp_path / "rooted")


@pytest.fixture
def cool_phone(rooted: Path) -> Path:
    """A rooted phone whose CPU reads 40 C, below every job's limit in these tests."""
    for zone in ("thermal_zone0", "thermal_zone1"):
        phone.set_value(rooted, f"/sys/class/thermal/{zone}/temp", 40000)
    return rooted


@pytest.fixture
def unrooted(tmp_path: Path) -> Path:
    return phone.build_tree(tmp_path / "unrooted", "unrooted")


@pytest.fixture
def termux(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[..., Path]:
    """termux(payload | hang=True): install a fake `termux-battery-status` first on PATH."""
    bin_dir = tmp_path / "termux-bin"

    def install(payload: dict | str | None = None, **kw: object) -> Path:
        script = phone.fake_termux(bin_dir, payload, **kw)  # type: ignore[arg-type]
        monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
        return script

    return install
