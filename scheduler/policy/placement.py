"""Gang placement: filter, score, admit all-or-nothing at min_devices, take up to max_devices."""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace

from scheduler.policy.filters import FILTERS, KEEP_FILTERS, run_filters
from scheduler.policy.scores import device_speed, score
from scheduler.policy.shards import balance_shards
from scheduler.policy.types import DeviceView, PlacementRequest


@dataclass(frozen=True)
class Placement:
    admitted: bool
    devices: tuple[str, ...] = ()
    shards: dict[int, str] = field(default_factory=dict)
    reason: str = ""
    # why the others were left out: {"cordoned": 3, "too hot": 1, ...}
    filtered: dict[str, int] = field(default_factory=dict)
    # a `class` job's compute class: the one it had, or the one this placement chose
    compute_class: str | None = None


def feasible(
    req: PlacementRequest, devices: Iterable[DeviceView]
) -> tuple[list[DeviceView], Counter[str]]:
    """The devices that pass every filter, and a count of why the rest did not."""
    ok: list[DeviceView] = []
    why: Counter[str] = Counter()
    for device in devices:
        status = run_filters(device, req, FILTERS)
        if status.ok:
            ok.append(device)
        else:
            why[_reason_kind(status.reason)] += 1
    return ok, why


def _reason_kind(reason: str) -> str:
    return reason.split(" (")[0] if "(" in reason else reason


def pick(req: PlacementRequest, candidates: Sequence[DeviceView], n: int) -> list[DeviceView]:
    """The n best-scored candidates (ties: lower id), without sorting the whole fleet."""
    if not candidates or n <= 0:
        return []
    fastest = max(device_speed(d, req.arch) for d in candidates)
    scored = ((score(d, req, fastest), d.id, d) for d in candidates)
    best = heapq.nsmallest(n, scored, key=lambda item: (-item[0], item[1]))
    return [d for _, _, d in best]


def waiting_reason(req: PlacementRequest, found: int, why: Counter[str]) -> str:
    detail = ", ".join(f"{n} {kind}" for kind, n in sorted(why.items(), key=lambda kv: -kv[1]))
    text = f"waiting for {req.min_devices - found} more device(s) (min_devices {req.min_devices}, {found} eligible)"
    return f"{text}; excluded: {detail}" if detail else text


OTHER_CLASS = "another compute class"


def compute_classes(req: PlacementRequest, candidates: Iterable[DeviceView]
                    ) -> list[tuple[str, int, float]]:
    """The compute classes of `candidates` (devices that pass every filter) as (fingerprint,
    devices, total speed for the job's arch), best first: a class with min_devices devices
    before one without, then the most total speed (measured samples/s where the agent
    profiled the model), then the most devices, then the lowest fingerprint."""
    groups: dict[str, list[DeviceView]] = {}
    for d in sorted(candidates, key=lambda d: d.id):  # the same sums whatever the order
        if d.compute_class is not None:
            groups.setdefault(d.compute_class, []).append(d)
    ranked = [(fp, len(ds), sum(device_speed(d, req.arch) for d in ds))
              for fp, ds in groups.items()]
    ranked.sort(key=lambda c: (c[1] < req.min_devices, -c[2], -c[1], c[0]))
    return ranked


def choose_compute_class(req: PlacementRequest, candidates: Iterable[DeviceView]) -> str | None:
    """The class a `class` job's first placement settles on (compute_classes' first); None:
    no candidate reports one."""
    ranked = compute_classes(req, candidates)
    return ranked[0][0] if ranked else None


def settle_class(req: PlacementRequest, ok: list[DeviceView], why: Counter[str]
                 ) -> tuple[PlacementRequest, list[DeviceView]]:
    """For a `class` job not yet placed: the request with its chosen class, and the feasible
    devices of that class (the others counted in `why`). Any other job: as given."""
    if not req.pinned or req.compute_class is not None:
        return req, ok
    chosen = choose_compute_class(req, ok)
    if chosen is None:
        return req, ok
    same = [d for d in ok if d.compute_class == chosen]
    if len(same) < len(ok):
        why[OTHER_CLASS] += len(ok) - len(same)
    return replace(req, compute_class=chosen), same


def place_gang(
    req: PlacementRequest,
    devices: Iterable[DeviceView],
    current: dict[int, str] | None = None,
) -> Placement:
    """Admit the job on at least min_devices and at most max_devices devices, or not at all.
    A `class` job goes on devices of one compute class: its own, or at its first placement
    the best class (`compute_classes`)."""
    ok, why = feasible(req, devices)
    req, ok = settle_class(req, ok, why)
    if len(ok) < req.min_devices:
        return Placement(False, reason=waiting_reason(req, len(ok), why), filtered=dict(why))
    chosen = pick(req, ok, req.wanted_devices)
    speeds = {d.id: device_speed(d, req.arch) for d in chosen}
    shards = balance_shards(req.shards, speeds, current or {})
    used = tuple(sorted(set(shards.values())))
    return Placement(True, used, shards, filtered=dict(why), compute_class=req.compute_class)


def keepable(req: PlacementRequest, device: DeviceView) -> bool:
    """Whether a device already in the job may keep its shards."""
    return run_filters(device, req, KEEP_FILTERS).ok


def rebalance(
    req: PlacementRequest,
    holders: Sequence[DeviceView],
    joiners: Sequence[DeviceView],
    current: dict[int, str],
    force_keep: frozenset[str] = frozenset(),
) -> Placement:
    """The job's shards over its keepable holders plus the best joiners, up to max_devices.

    Holders that may stay are kept first (they have the shard data cached); joiners fill the
    remaining places. `force_keep`: holders kept although they fail (a lease-loss eviction the
    rate limit holds back). Below min_devices the job is not admitted and must wait.
    """
    staying = [d for d in holders if d.id in force_keep or keepable(req, d)]
    room = max(0, req.wanted_devices - len(staying))
    ok_joiners, why = feasible(req, [d for d in joiners if d.id not in {h.id for h in staying}])
    chosen = list(staying[: req.wanted_devices]) + pick(req, ok_joiners, room)
    if len(chosen) < req.min_devices:
        return Placement(False, reason=waiting_reason(req, len(chosen), why), filtered=dict(why))
    speeds = {d.id: device_speed(d, req.arch) for d in chosen}
    shards = balance_shards(req.shards, speeds, current)
    return Placement(True, tuple(sorted(set(shards.values()))), shards, filtered=dict(why),
                     compute_class=req.compute_class)
