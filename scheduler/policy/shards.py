"""Shards per device proportional to speed (largest remainder), moving as few shards as possible."""

from __future__ import annotations

import math
from collections.abc import Mapping


def proportional_counts(total: int, weights: Mapping[str, float]) -> dict[str, int]:
    """Split `total` into integers proportional to `weights` by the largest-remainder method.

    Every device with a positive weight gets at least one shard when total allows it (a device
    in a job with nothing to do would only hold a phone hostage). Ties go to the lower id.
    Any float is a weight: one that is not a finite positive number (NaN, infinite, zero,
    negative) counts as zero, and all zero split evenly; the counts always add up to `total`.
    """
    names = sorted(weights)
    if not names or total <= 0:
        return {name: 0 for name in names}
    usable = {n: _weight(weights[n]) for n in names}
    top = max(usable.values())
    # relative to the largest, each in [0, 1]: no sum or product below overflows (1e308 * 8)
    relative = {n: usable[n] / top for n in names} if top else {n: 1.0 for n in names}
    wsum = sum(relative.values())  # >= 1: the largest is 1
    quotas = {n: min(float(total), total * relative[n] / wsum) for n in names}
    counts = {n: int(quotas[n]) for n in names}
    leftover = max(0, total - sum(counts.values()))
    by_remainder = sorted(names, key=lambda n: (-(quotas[n] - counts[n]), n))
    for name in by_remainder[:leftover]:
        counts[name] += 1
    _lift_zeros(counts, quotas)
    return counts


def _weight(value: float) -> float:
    """A weight as a finite float >= 0: NaN, infinities, negatives and non-numbers are 0."""
    try:
        weight = float(value)
    except (TypeError, ValueError, OverflowError):
        return 0.0
    return weight if math.isfinite(weight) and weight > 0 else 0.0


def _lift_zeros(counts: dict[str, int], quotas: Mapping[str, float]) -> None:
    """Give a zero-share device one shard from the device with the most, while that is > 1."""
    for name in sorted(counts, key=lambda n: (-quotas[n], n)):
        if counts[name]:
            continue
        donor = max(counts, key=lambda n: (counts[n], -quotas[n], n))
        if counts[donor] <= 1:
            return
        counts[donor] -= 1
        counts[name] = 1


def balance_shards(
    shards: int, speeds: Mapping[str, float], current: Mapping[int, str]
) -> dict[int, str]:
    """Map every shard 0..shards-1 to a device, proportional to speed, keeping shards in place.

    `current` is who holds what now (shards of departed devices may be missing or name devices
    not in `speeds`). A device keeps its lowest-numbered current shards up to its count; the
    rest go, in shard order, to devices below their count, in device-id order. Deterministic.
    """
    counts = proportional_counts(shards, speeds)
    placed: dict[int, str] = {}
    held: dict[str, int] = {d: 0 for d in counts}
    for shard in range(shards):
        device = current.get(shard)
        if device in counts and held[device] < counts[device]:
            placed[shard] = device
            held[device] += 1
    hungry = [d for d in sorted(counts) for _ in range(counts[d] - held[d])]
    loose = [s for s in range(shards) if s not in placed]
    placed.update(zip(loose, hungry))
    return dict(sorted(placed.items()))


def moved_shards(before: Mapping[int, str], after: Mapping[int, str]) -> list[int]:
    return sorted(s for s, d in after.items() if before.get(s) != d)
