"""Preemption: a higher-priority gang may take devices from lower-priority jobs."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

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
    min_devices would stop anyway.
    """
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
    return []
