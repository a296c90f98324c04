"""Filters (the Kubernetes scheduler's shape): each says whether a device may run a job, and why not.

`Unschedulable` may pass later by itself (battery charges, phone cools down, lease renews);
`UnschedulableAndUnresolvable` needs a person (cordon, label selector, missing capability).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from scheduler.policy.types import DeviceView, PlacementRequest
from wire.states import DeviceState

SUCCESS = "Success"
UNSCHEDULABLE = "Unschedulable"
UNRESOLVABLE = "UnschedulableAndUnresolvable"


@dataclass(frozen=True)
class FilterStatus:
    code: str
    reason: str = ""

    @property
    def ok(self) -> bool:
        return self.code == SUCCESS


OK = FilterStatus(SUCCESS)


def ready(device: DeviceView, req: PlacementRequest) -> FilterStatus:
    if device.state == DeviceState.READY:
        return OK
    return FilterStatus(UNSCHEDULABLE, f"not ready ({device.state})")


def schedulable(device: DeviceView, req: PlacementRequest) -> FilterStatus:
    if device.cordoned or device.state == DeviceState.CORDONED:
        return FilterStatus(UNRESOLVABLE, "cordoned")
    if device.draining or device.state == DeviceState.DRAINING:
        return FilterStatus(UNRESOLVABLE, "draining")
    return OK


def not_paused(device: DeviceView, req: PlacementRequest) -> FilterStatus:
    if device.pause_reason:
        return FilterStatus(UNSCHEDULABLE, f"paused ({device.pause_reason})")
    return OK


def not_upgrading(device: DeviceView, req: PlacementRequest) -> FilterStatus:
    if device.upgrading:
        return FilterStatus(UNSCHEDULABLE, "installing a new agent")
    return OK


def label_selector(device: DeviceView, req: PlacementRequest) -> FilterStatus:
    for key, value in req.selector.items():
        if device.labels.get(key) != value:
            return FilterStatus(UNRESOLVABLE, f"label {key}!={value}")
    return OK


def battery(device: DeviceView, req: PlacementRequest) -> FilterStatus:
    if device.charging or device.battery_pct is None:
        return OK
    if device.battery_pct < req.min_battery:
        return FilterStatus(UNSCHEDULABLE, f"battery {device.battery_pct:g}% < {req.min_battery:g}%")
    return OK


def temperature(device: DeviceView, req: PlacementRequest) -> FilterStatus:
    if device.temp_c is not None and device.temp_c > req.max_temp_c:
        return FilterStatus(UNSCHEDULABLE, f"too hot ({device.temp_c:g} C > {req.max_temp_c:g} C)")
    return OK


def capability(device: DeviceView, req: PlacementRequest) -> FilterStatus:
    if device.archs is not None and req.arch not in device.archs:
        return FilterStatus(UNRESOLVABLE, f"agent lacks arch {req.arch}")
    if req.backend != "any" and device.backends is not None and req.backend not in device.backends:
        return FilterStatus(UNRESOLVABLE, f"agent lacks backend {req.backend}")
    missing = req.features - device.features
    if missing:
        return FilterStatus(UNRESOLVABLE, f"agent lacks {', '.join(sorted(missing))} "
                            "(upgrade it)")
    return OK


def same_compute_class(device: DeviceView, req: PlacementRequest) -> FilterStatus:
    """A `class` job's shards stay on one compute class (invariant 1): its bits are those of
    the float32 kernels of one machine kind, so a shard computed on another would be another
    function. Before the job's first placement any device that reports a class passes (the
    placement then settles on one: `placement.choose_compute_class`); an agent that reports no
    class (older) never takes a class job's shard. A portable job passes everywhere."""
    if not req.pinned:
        return OK
    if device.compute_class is None:
        return FilterStatus(UNRESOLVABLE, "agent reports no compute class (upgrade it)")
    if req.compute_class is not None and device.compute_class != req.compute_class:
        return FilterStatus(UNRESOLVABLE, f"another compute class (the job's is "
                            f"#{req.compute_class[:8]})")
    return OK


# Of a phone's RAM, what a training agent may count on: Android keeps the system, the launcher
# and recent apps resident, and kills the biggest process first when memory runs short.
USABLE_RAM_SHARE = 0.5


def memory(device: DeviceView, req: PlacementRequest) -> FilterStatus:
    if req.memory_mb is None or device.ram_mb is None:
        return OK
    usable = device.ram_mb * USABLE_RAM_SHARE
    if req.memory_mb > usable:
        return FilterStatus(UNRESOLVABLE, f"too little memory (needs {req.memory_mb:,.0f} MiB "
                            f"per micro-batch, {usable:,.0f} MiB usable of {device.ram_mb:,.0f})")
    return OK


def fits_no_phone(devices: Sequence[DeviceView], req: PlacementRequest) -> str | None:
    """Why no phone of the fleet could ever hold the job's micro-batch, or None (it fits one,
    or no phone has said how much memory it has)."""
    known = [d.ram_mb for d in devices if d.ram_mb is not None]
    if req.memory_mb is None or not known:
        return None
    largest = max(known) * USABLE_RAM_SHARE
    if req.memory_mb <= largest:
        return None
    return (f"needs {req.memory_mb:,.0f} MiB per phone for one micro-batch, but the largest "
            f"phone has {largest:,.0f} MiB usable: use more shards (a smaller micro-batch) or a "
            f"smaller model")


def free(device: DeviceView, req: PlacementRequest) -> FilterStatus:
    if device.job_id is None or device.job_id == req.job_id:
        return OK
    return FilterStatus(UNSCHEDULABLE, "busy with another job")


Filter = Callable[[DeviceView, PlacementRequest], FilterStatus]

# Cheap and decisive first: most devices of a big fleet fail on the first two.
FILTERS: tuple[Filter, ...] = (
    ready, schedulable, not_paused, not_upgrading, label_selector, capability,
    same_compute_class, memory, battery, temperature, free,
)
# What keeps a device in a job it already runs: only what the device or an admin said.
# Battery and heat are the agent's to judge (it pauses itself and reports pause_reason); a
# device that now reports another compute class (its numpy or BLAS changed) leaves a class job.
KEEP_FILTERS: tuple[Filter, ...] = (ready, schedulable, not_paused, same_compute_class)


def run_filters(
    device: DeviceView, req: PlacementRequest, filters: tuple[Filter, ...] = FILTERS
) -> FilterStatus:
    for check in filters:
        status = check(device, req)
        if not status.ok:
            return status
    return OK
