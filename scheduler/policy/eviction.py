"""Rate-limited eviction, after Kubernetes' node lifecycle controller.

When a large part of the fleet loses its lease at once, the likely cause is the network or the
control plane, not the phones: tearing every job apart would cost more than waiting. So lease
loss moves shards freely while the fleet looks healthy, and only slowly while it looks disrupted.
Evictions the device or an admin asked for (pause, drain, cordon) are never limited.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class EvictionLimits:
    window_s: float = 60.0
    per_window: int = 1000  # healthy fleet: effectively unlimited
    disrupted_fraction: float = 0.55  # more NotReady than this: the fleet looks disrupted
    disrupted_per_window: int = 1
    min_fleet: int = 3  # below this a fraction means nothing


def is_disrupted(fleet_size: int, not_ready: int, limits: EvictionLimits) -> bool:
    if fleet_size < limits.min_fleet:
        return False
    return not_ready / fleet_size > limits.disrupted_fraction


def allowed_evictions(
    fleet_size: int,
    not_ready: int,
    recent: Sequence[float],
    now: float,
    limits: EvictionLimits = EvictionLimits(),
) -> int:
    """How many lease-loss evictions may happen now, given the times of recent ones."""
    in_window = sum(1 for t in recent if now - t < limits.window_s)
    cap = limits.disrupted_per_window if is_disrupted(fleet_size, not_ready, limits) else limits.per_window
    return max(0, cap - in_window)


def prune(recent: Sequence[float], now: float, limits: EvictionLimits = EvictionLimits()) -> list[float]:
    return [t for t in recent if now - t < limits.window_s]
