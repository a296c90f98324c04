"""Stragglers: when a device is late with its shards, a second device computes them too."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence


def expected_step_s(latencies: Mapping[str, float], fallback: float | None = None) -> float | None:
    """The job's typical time from step start to a device's last upload (median of devices).

    Shards are proportional to speed, so every device should need about the same time; the
    median ignores the straggler itself.
    """
    values = [v for v in latencies.values() if v > 0]
    if not values:
        return fallback
    return statistics.median(values)


def straggler_timeout(expected: float | None, floor_s: float, factor: float = 3.0) -> float:
    if expected is None:
        return max(floor_s, 10.0 * floor_s)  # nothing measured yet: be patient
    return max(floor_s, factor * expected)


def plan_backups(
    missing: Mapping[str, Sequence[int]],
    helpers: Sequence[str],
    backed_up: frozenset[int] = frozenset(),
    auditing: Mapping[int, frozenset[str]] | None = None,
) -> dict[int, str]:
    """Give each late shard (not yet backed up) to a helper, round-robin in the given order.

    `missing`: device -> its shards not yet uploaded; `helpers`: devices of the job that are
    done with this step, best first. A device never backs up its own shards, nor a shard it
    audits (`auditing`: shard -> its auditors; an audit compares two devices' results).
    """
    plan: dict[int, str] = {}
    if not helpers:
        return plan
    turn = 0
    for device in sorted(missing):
        for shard in sorted(missing[device]):
            if shard in backed_up:
                continue
            barred = (auditing or {}).get(shard, frozenset())
            choices = [h for h in helpers if h != device and h not in barred]
            if not choices:
                continue
            plan[shard] = choices[turn % len(choices)]
            turn += 1
    return plan


def persistent_stragglers(late_steps: Mapping[str, Sequence[int]], finished_step: int,
                          streak: int = 2) -> list[str]:
    """Devices late in each of the last `streak` steps up to `finished_step`: their share of
    shards should shrink, or every step waits for a timeout and a backup."""
    wanted = set(range(finished_step - streak + 1, finished_step + 1))
    return sorted(d for d, steps in late_steps.items() if wanted <= set(steps))


def demoted_speeds(speeds: Mapping[str, float], slow: Mapping[str, float]) -> dict[str, float]:
    """Speeds for shard balancing with each demoted device scaled by its factor (0..1]."""
    return {d: s * slow.get(d, 1.0) for d, s in speeds.items()}
