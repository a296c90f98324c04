"""PHALANX_AGENT_SLOWDOWN(_FILE): a phone made slow on purpose, changeable while it runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent.runtime import slowdown


def test_the_variable_sets_the_factor(monkeypatch: pytest.MonkeyPatch) -> None:
    assert slowdown.factor() == 1.0
    monkeypatch.setenv("PHALANX_AGENT_SLOWDOWN", "3.5")
    assert slowdown.factor() == 3.5


@pytest.mark.parametrize("bad", ["0.5", "-2", "fast", "nan", ""])
def test_nonsense_means_no_slowdown(monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    monkeypatch.setenv("PHALANX_AGENT_SLOWDOWN", bad)
    assert slowdown.factor() == 1.0


def test_the_file_is_reread_every_time_and_wins(monkeypatch: pytest.MonkeyPatch,
                                                tmp_path: Path) -> None:
    path = tmp_path / "slow"
    monkeypatch.setenv("PHALANX_AGENT_SLOWDOWN", "2")
    monkeypatch.setenv("PHALANX_AGENT_SLOWDOWN_FILE", str(path))
    assert slowdown.factor() == 2.0  # no file yet: the variable
    path.write_text("4\n")
    assert slowdown.factor() == 4.0
    path.write_text("1")
    assert slowdown.factor() == 1.0
    assert slowdown.apply(10.0) == 0.0  # factor 1: no sleep at all
