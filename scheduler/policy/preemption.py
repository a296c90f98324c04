"""Preemption: a higher-priority gang may take devices from lower-priority jobs."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

from scheduler.policy.filters import FILTERS, free, run_filters
from scheduler.policy.types import DeviceView, PlacementRequest, RunningJob

# Every filter but "free": which devices could run the job if their current job let go.
_ALL_BUT_FREE = tuple(f for f in FILTERS if f is not free)


def plan_preemption(
    req: PlacementRequest, devices: Iterable[DeviceView], running: Sequence[RunningJob]
) -> list[str]:
    """Jobs to preempt so that `req` reaches min_devices; [] when it fits or cannot be helped.

    Victims are only jobs of strictly lower priority, lowest priority first (then fewest devices,
    then id), and only as many as needed. A victim is preempted whole: a gang below its own
    min_devices would stop anyway. A `class` job not yet placed counts each compute class
    apart (its shards will go on one): the class that needs the fewest victims.
    """
    devices = list(devices)
    if req.pinned and req.compute_class is None:
        classes = sorted({d.compute_class for d in devices if d.compute_class is not None})
        plans = [_victims(replace(req, compute_class=c), devices, running) for c in classes]
        found = [p for p in plans if p is not None]
        return min(found, key=len) if found else []  # the first of equals: the lowest class
    return _victims(req, devices, running) or []


def _victims(req: PlacementRequest, devices: Sequence[DeviceView],
             running: Sequence[RunningJob]) -> list[str] | None:
    """The victims, [] when the job fits as it is, None when preemption cannot help."""
    usable = [d for d in devices if run_filters(d, req, _ALL_BUT_FREE).ok]
    have = sum(1 for d in usable if d.job_id in (None, req.job_id))
    if have >= req.min_devices:
        return []
    gain: dict[str, int] = {}
    for d in usable:
        if d.job_id is not None and d.job_id != req.job_id:
            gain[d.job_id] = gain.get(d.job_id, 0) + 1
    victims: list[str] = []
    lower = sorted((j for j in running if j.priority < req.priority and gain.get(j.id)),
                   key=lambda j: (j.priority, len(j.devices), j.id))
    for job in lower:
        victims.append(job.id)
        have += gain[job.id]
        if have >= req.min_devices:
            return victims
    return None
