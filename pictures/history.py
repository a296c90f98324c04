"""The fleet's last hour, as the fleet page's sparklines draw it: per phone its battery, its
temperature and the samples a second it trained, one point per time bucket (at most 60).

The store gives averages per (phone, bucket) and the samples each job's steps trained per
bucket; a phone's share of a job's samples is the share of the job's shards it held then
(the placement events' `counts`, pictures.report.holdings)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pictures.report import event_steps, holdings

Series = list[tuple[float, float]]


@dataclass
class DeviceHistory:
    """One phone's last hour: (seconds before now, value), oldest first."""

    battery: Series = field(default_factory=list)
    temp: Series = field(default_factory=list)
    rate: Series = field(default_factory=list)

    @property
    def latest_rate(self) -> float | None:
        return self.rate[-1][1] if self.rate else None


@dataclass(frozen=True)
class Buckets:
    """The hour cut into `count` buckets of `width_s` seconds; bucket 0 starts `count *
    width_s` seconds before now."""

    count: int = 60
    width_s: float = 60.0

    def age(self, bucket: int) -> float:
        """A bucket's middle, in seconds before now (negative: a sparkline's x)."""
        return -(self.count - bucket - 0.5) * self.width_s

    def clamp(self, bucket: Any) -> int:
        return min(max(int(bucket), 0), self.count - 1)


def telemetry_history(rows: Iterable[Sequence[Any]], buckets: Buckets
                      ) -> dict[str, DeviceHistory]:
    """rows of (device id, bucket, mean battery %, mean battery °C, mean CPU °C): the hottest
    of the two temperatures is the phone's; rows past either end join the end's bucket."""
    merged: dict[tuple[str, int], list[list[float]]] = {}
    for device, bucket, battery, battery_c, cpu_c in rows:
        temps = [float(t) for t in (battery_c, cpu_c) if t is not None]
        slot = merged.setdefault((str(device), buckets.clamp(bucket)), [[], []])
        slot[0] += [float(battery)] if battery is not None else []
        slot[1] += [max(temps)] if temps else []
    out: dict[str, DeviceHistory] = {}
    for (device, bucket), (battery_pcts, temps) in sorted(merged.items()):
        h = out.setdefault(device, DeviceHistory())
        if battery_pcts:
            h.battery.append((buckets.age(bucket), sum(battery_pcts) / len(battery_pcts)))
        if temps:
            h.temp.append((buckets.age(bucket), sum(temps) / len(temps)))
    return out


def device_rates(samples: Iterable[Sequence[Any]],
                 placements: Mapping[str, Sequence[dict[str, Any]]], buckets: Buckets
                 ) -> dict[str, Series]:
    """Samples a second per phone and bucket: `samples` rows of (job id, bucket, samples
    trained, first step, last step); `placements`: each job's events that carry `counts`. A
    phone's part of a bucket's samples is its share of the job's shards at the bucket's middle
    step; a bucket it trained nothing in is 0, from its first bucket on."""
    lanes = {job: holdings(event_steps(list(events), []), float("inf"))
             for job, events in placements.items()}
    per_bucket: dict[str, dict[int, float]] = {}
    for job, bucket, n, first, last in samples:
        held = _held_at(lanes.get(str(job), {}), (float(first) + float(last)) / 2)
        total = sum(held.values())
        for device, count in held.items():
            slot = per_bucket.setdefault(device, {})
            b = buckets.clamp(bucket)
            slot[b] = slot.get(b, 0.0) + float(n) * count / total / buckets.width_s
    return {device: [(buckets.age(b), slot.get(b, 0.0)) for b in range(min(slot),
                                                                          buckets.count)]
            for device, slot in per_bucket.items()}


def _held_at(lanes: Mapping[str, Sequence[tuple[float, float, int]]], step: float
             ) -> dict[str, int]:
    return {device: held for device, spans in lanes.items()
            for since, until, held in spans if since <= step < until}
