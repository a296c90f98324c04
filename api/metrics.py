"""Prometheus metrics: the registry and `/metrics` exposition (see docs/contracts.md)."""

from __future__ import annotations


def observe_task(name: str, seconds: float, ok: bool) -> None:
    """Record one scheduler task run (reconcile, apply_step)."""
