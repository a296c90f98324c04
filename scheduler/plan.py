"""A job's placement seen before it is submitted: which devices could run it and why not.

The API asks this for `POST /v1/jobs?dry_run=true` and at every submit (a job no phone could
ever hold is refused); the answer comes from the same filters placement runs.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from domain.store.compute_class import label
from domain.store.models import Device
from scheduler.policy.filters import fits_no_phone, run_filters
from scheduler.policy.placement import compute_classes
from scheduler.policy.types import DeviceView, PlacementRequest
from scheduler.store_ops import all_device_views

LISTED = 100  # devices named per answer; the counts cover the whole fleet


def request_for(spec: dict[str, Any], memory_bytes: int | None) -> PlacementRequest:
    return PlacementRequest.from_spec("", spec, int(spec.get("priority", 0)),
                                      memory_mb=None if memory_bytes is None
                                      else memory_bytes / 2**20)


def refusal(session: Session, req: PlacementRequest) -> str | None:
    """Why the fleet could never hold this job (memory), or None."""
    return fits_no_phone(all_device_views(session), req)


def eligibility(session: Session, req: PlacementRequest) -> dict[str, Any]:
    """Every device through the placement filters: the ones that could take the job now, and
    for the others the first reason each fails on."""
    eligible: list[DeviceView] = []
    refused: list[dict[str, str]] = []
    reasons: Counter[str] = Counter()
    for device in all_device_views(session):
        status = run_filters(device, req)
        if status.ok:
            eligible.append(device)
            continue
        reasons[status.reason] += 1
        if len(refused) < LISTED:
            refused.append({"device": device.id, "reason": status.reason})
    answer: dict[str, Any] = {
        "exactness": req.exactness, "eligible": len(eligible),
        "eligible_devices": [d.id for d in eligible[:LISTED]],
        "ineligible": sum(reasons.values()), "ineligible_devices": refused,
        "reasons": dict(reasons.most_common())}
    if req.pinned:
        answer["compute_classes"] = classes_of(session, req, eligible)
    return answer


def classes_of(session: Session, req: PlacementRequest, eligible: list[DeviceView]
               ) -> list[dict[str, Any]]:
    """A `class` job's choice now: each compute class of the eligible devices, the one its
    first placement would take first (placement.compute_classes)."""
    ranked = compute_classes(req, eligible)[:LISTED]
    holders = {fp: next(d.id for d in eligible if d.compute_class == fp) for fp, _, _ in ranked}
    rows = session.scalars(select(Device).where(Device.id.in_(list(holders.values()))))
    facts = {d.id: d.capabilities.get("compute_class") if isinstance(d.capabilities, dict)
             else None for d in rows}  # a stored value, any JSON: label() checks the rest
    return [{"fingerprint": fp, "label": label(facts.get(holders[fp])), "devices": n,
             "speed": round(speed, 3)} for fp, n, speed in ranked]
