"""Celery's in-memory transport (embedded mode), woken by each message instead of polled.

Kombu's memory transport has nothing to block on, so its worker sleeps `polling_interval`
between empty reads: measured at 5 ms, an apply_step waited 4.6 ms (median) to start after its
step's last upload, and the idle worker woke 200 times a second. Here every message put on any
queue, and every ack or reject (which frees the worker's prefetch window), advances a
generation counter under a condition; a worker that found nothing to take waits for the
counter to move (or for `polling_interval`, now only a safety net).
"""

from __future__ import annotations

import threading
import time
from queue import Empty
from typing import Any

from kombu.transport import memory

_ARRIVED = threading.Condition()
_generation = 0


def _notify() -> None:
    global _generation
    with _ARRIVED:
        _generation += 1
        _ARRIVED.notify_all()


def _current() -> int:
    with _ARRIVED:
        return _generation


class Channel(memory.Channel):
    """Wakes waiting workers on every put, and on every ack or reject: a worker whose prefetch
    window is full reads nothing until one of its tasks is acknowledged."""

    def basic_ack(self, delivery_tag: Any, multiple: bool = False) -> None:
        super().basic_ack(delivery_tag, multiple)
        _notify()

    def basic_reject(self, delivery_tag: Any, requeue: bool = False) -> None:
        super().basic_reject(delivery_tag, requeue)
        _notify()

    def _put(self, queue: str, message: Any, **kwargs: Any) -> None:
        super()._put(queue, message, **kwargs)
        _notify()

    def _put_fanout(self, exchange: str, message: Any, routing_key: str | None = None,
                    **kwargs: Any) -> None:
        super()._put_fanout(exchange, message, routing_key, **kwargs)
        _notify()


class Transport(memory.Transport):
    Channel = Channel

    def drain_events(self, connection: Any, timeout: float | None = None) -> None:
        started = time.monotonic()
        while True:
            seen = _current()  # BEFORE the read: a message put after it moves the counter
            try:
                self.cycle.get(self._deliver, timeout=timeout)
                return
            except Empty:
                pass
            wait = self.polling_interval
            if timeout is not None:
                left = timeout - (time.monotonic() - started)
                if left <= 0:
                    raise TimeoutError  # socket.timeout: what the worker's loop expects
                wait = min(wait, left) if wait is not None else left
            with _ARRIVED:
                _ARRIVED.wait_for(lambda seen=seen: _generation != seen, wait)
