"""The agent's recent log lines, kept in a bounded ring so an operator can read them from the
control plane (`phalanx devices logs`): the server asks with a heartbeat command, the agent
ships the ring. Nothing is written to the phone's storage for it."""

from __future__ import annotations

import json
import logging
import threading
from collections import deque
from typing import Any

CAPACITY = 500  # lines kept
MAX_CHARS = 1000  # of one line (a traceback is cut): 500 lines stay well under 1 MiB


class LogRing(logging.Handler):
    def __init__(self, capacity: int = CAPACITY) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        self._lines: deque[dict[str, Any]] = deque(maxlen=capacity)
        self._seq = 0
        self._lock_ring = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = self.format(record)[:MAX_CHARS]
        except Exception:  # a bad format string must not break the agent's logging
            message = str(record.msg)[:MAX_CHARS]
        with self._lock_ring:
            self._seq += 1
            self._lines.append({"seq": self._seq, "ts": record.created,
                                "level": record.levelname[:10], "message": message})

    def snapshot(self) -> list[dict[str, Any]]:
        with self._lock_ring:
            return list(self._lines)


RING = LogRing()
MAX_SHIPPED_BYTES = 900_000  # of the JSON body: under the control plane's 1 MiB limit


def fitting(lines: list[dict[str, Any]], max_bytes: int = MAX_SHIPPED_BYTES
            ) -> list[dict[str, Any]]:
    """The newest of `lines` whose JSON body stays under max_bytes (the oldest go first)."""
    sizes = [len(json.dumps(line)) + 2 for line in lines]
    total, start = sum(sizes) + 16, 0
    while total > max_bytes and start < len(lines):
        total -= sizes[start]
        start += 1
    return lines[start:]


def install(logger: logging.Logger | None = None) -> LogRing:
    """Keep the agent's log lines (INFO and up) in RING; idempotent."""
    target = logger or logging.getLogger()
    if RING not in target.handlers:
        RING.setLevel(logging.INFO)
        target.addHandler(RING)
    return RING
