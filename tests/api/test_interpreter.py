"""Process-wide interpreter settings of a serving process."""

from __future__ import annotations

import os
import sys

import pytest
from pydantic import ValidationError

from api.process import tune_interpreter
from domain.settings import Settings
from engine.memory import MALLOC_TUNABLES
from wire.buffers import BUFFERS


def test_the_server_sets_the_gil_switch_interval_from_its_settings(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("GLIBC_TUNABLES", "")  # tune_interpreter sets it; restored after the test
    before = sys.getswitchinterval()
    try:
        tune_interpreter(Settings(data_dir=tmp_path))
        assert sys.getswitchinterval() == pytest.approx(0.001)  # the default, not CPython's 5 ms
        tune_interpreter(Settings(data_dir=tmp_path, gil_switch_interval_s=0.003))
        assert sys.getswitchinterval() == pytest.approx(0.003)
    finally:
        sys.setswitchinterval(before)


def test_the_server_keeps_a_steps_arrays_and_its_worker_processes_start_keeping_them(
        tmp_path, monkeypatch) -> None:
    """uvicorn's worker processes (`phalanx server --workers N`) inherit the environment:
    GLIBC_TUNABLES carries engine.memory's tunables to them, beside the operator's own."""
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=4")
    for old in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"):
        monkeypatch.delenv(old, raising=False)
    before, pool = sys.getswitchinterval(), BUFFERS.max_bytes
    try:
        tune_interpreter(Settings(data_dir=tmp_path, buffer_pool_mb=64))
        assert BUFFERS.max_bytes == 64 << 20  # PHALANX_BUFFER_POOL_MB
    finally:  # (glibc's mallopt stays set in this process: it only keeps freed blocks longer)
        sys.setswitchinterval(before)
        BUFFERS.max_bytes = pool
    assert os.environ["GLIBC_TUNABLES"] == f"glibc.malloc.arena_max=4:{MALLOC_TUNABLES}"


def test_a_switch_interval_out_of_range_is_refused(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PHALANX_GIL_SWITCH_INTERVAL_S", "0")
    with pytest.raises(ValidationError, match="gil_switch_interval_s"):
        Settings(data_dir=tmp_path)
