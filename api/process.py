"""Process-wide settings of a process that serves steps or applies them (`phalanx server`, its
uvicorn worker processes, `phalanx worker`); not for tests that build apps."""

from __future__ import annotations

import sys

from domain.settings import Settings
from engine.memory import keep_big_blocks
from wire.buffers import BUFFERS


def tune_interpreter(settings: Settings) -> list[str]:
    """A GIL switch interval of 1 ms instead of 5 took the 8-agent coordination benchmark's step
    from 135-140 to 118-129 ms (docs/benchmarks.md): an I/O thread that wants the GIL back after a
    socket call waits for a Python-busy thread at most that long. Each step's buffers are handed
    out again (wire.buffers) and glibc's malloc keeps the rest of its arrays (engine.memory).
    Returns the malloc tunables set in this process."""
    sys.setswitchinterval(settings.gil_switch_interval_s)
    BUFFERS.max_bytes = settings.buffer_pool_mb << 20
    return keep_big_blocks()
