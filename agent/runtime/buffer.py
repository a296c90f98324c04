"""Telemetry kept while the control plane is unreachable: bounded, sent oldest first."""

from __future__ import annotations

import threading
from collections import deque
from typing import Any


class TelemetryBuffer:
    """A bounded FIFO. When full the oldest sample is dropped: recent state matters most."""

    def __init__(self, maxlen: int = 1000) -> None:
        self._items: deque[dict[str, Any]] = deque(maxlen=max(1, maxlen))
        self._lock = threading.Lock()
        self.dropped = 0

    def append(self, sample: dict[str, Any]) -> None:
        with self._lock:
            if len(self._items) == self._items.maxlen:
                self.dropped += 1
            self._items.append(sample)

    def peek(self, limit: int) -> list[dict[str, Any]]:
        """The oldest `limit` samples, left in place until `confirm` says they arrived."""
        with self._lock:
            return [self._items[i] for i in range(min(limit, len(self._items)))]

    def confirm(self, sent: list[dict[str, Any]]) -> None:
        """Drop the samples the server accepted (those at the head, unless already evicted)."""
        with self._lock:
            for sample in sent:
                if self._items and self._items[0] is sample:
                    self._items.popleft()

    def __len__(self) -> int:
        with self._lock:
            return len(self._items)
