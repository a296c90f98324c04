"""Frozen inputs of the placement policy: what a pure function may know about devices and jobs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

from engine.kernels import DEFAULT_EXACTNESS
from wire.states import DeviceState

EMPTY: Mapping[str, str] = MappingProxyType({})
# samples/s: the most a measured speed may say (the heartbeat's bound,
# api.schemas.devices.MAX_SAMPLES_PER_S); a stored one beyond it counts as not measured
MAX_SPEED = 1e8


@dataclass(frozen=True)
class DeviceView:
    id: str
    state: str = DeviceState.READY.value
    cordoned: bool = False
    draining: bool = False
    pause_reason: str | None = None
    labels: Mapping[str, str] = field(default_factory=lambda: EMPTY)
    battery_pct: float | None = None
    charging: bool | None = None
    temp_c: float | None = None  # the hottest of cpu/battery temperature, as last reported
    archs: frozenset[str] | None = None  # None: the agent did not say (assume it can)
    backends: frozenset[str] | None = None
    # what the agent computes beyond an arch (augment, label_smoothing, upload_precision);
    # empty: an agent from before features were named, which computes none of them
    features: frozenset[str] = frozenset()
    cpu_cores: int = 4
    ram_mb: float | None = None  # the phone's memory, as its agent reported at enrollment
    # measured samples/s per arch, from the agent's profiles
    speeds: Mapping[str, float] = field(default_factory=lambda: EMPTY)
    job_id: str | None = None  # the job this device already holds shards of
    upgrading: bool = False  # installing a new agent (scheduler.policy.upgrades)
    # the fingerprint of its compute class (engine.compute_class): a `class` job's shards stay
    # on one; None: an agent that does not report it (older), which never takes a class job
    compute_class: str | None = None


def job_features(spec: Mapping[str, Any]) -> frozenset[str]:
    """What a job asks of a phone's agent beyond computing its arch: an agent that does not say
    it computes these would compute another function (and break invariant 1). `portable`: the
    job's shards must give the same bits on any CPU, and an older agent computes only the
    `class` path."""
    augment = spec.get("augment") or {}
    wanted = {"augment": bool(augment.get("crop_padding") or augment.get("horizontal_flip")),
              "label_smoothing": bool(spec.get("label_smoothing")),
              "upload_precision": spec.get("upload_precision", "float32") != "float32",
              "portable": job_exactness(spec) == "portable"}
    return frozenset(name for name, needed in wanted.items() if needed)


def job_exactness(spec: Mapping[str, Any]) -> str:
    """`portable` (the same bits on any CPU) or `class` (bits of one compute class)."""
    return str(spec.get("exactness", DEFAULT_EXACTNESS))


class JobLike(Protocol):
    id: str
    spec: Mapping[str, Any]
    priority: int
    plan: Mapping[str, Any] | None
    compute_class: str | None


@dataclass(frozen=True)
class PlacementRequest:
    job_id: str
    arch: str
    shards: int
    min_devices: int = 1
    max_devices: int = 8
    selector: Mapping[str, str] = field(default_factory=lambda: EMPTY)
    min_battery: float = 20.0
    max_temp_c: float = 45.0
    backend: str = "any"
    priority: int = 0
    memory_mb: float | None = None  # a phone's need for one micro-batch (engine.plan)
    features: frozenset[str] = frozenset()  # what its phones must compute (job_features)
    exactness: str = DEFAULT_EXACTNESS  # engine.kernels: portable or class
    # a `class` job's compute class (fingerprint), chosen at its first placement; None before
    compute_class: str | None = None

    @classmethod
    def for_job(cls, job: JobLike) -> PlacementRequest:
        plan = job.plan or {}
        need = plan.get("memory_per_device_bytes")
        return cls.from_spec(job.id, job.spec, job.priority,
                             memory_mb=need / 2**20 if isinstance(need, (int, float)) else None,
                             compute_class=job.compute_class)

    @classmethod
    def from_spec(cls, job_id: str, spec: Mapping[str, Any], priority: int = 0,
                  memory_mb: float | None = None,
                  compute_class: str | None = None) -> PlacementRequest:
        placement = spec.get("placement") or {}
        return cls(
            job_id=job_id,
            arch=str((spec.get("model") or {}).get("arch", "")),
            shards=int(spec.get("shards", 16)),
            min_devices=int(placement.get("min_devices", 1)),
            max_devices=int(placement.get("max_devices", 8)),
            selector=MappingProxyType(dict(placement.get("selector") or {})),
            min_battery=float(placement.get("min_battery", 20)),
            max_temp_c=float(placement.get("max_temp_c", 45)),
            backend=str(placement.get("backend", "any")),
            priority=int(spec.get("priority", priority)),
            memory_mb=memory_mb,
            features=job_features(spec),
            exactness=job_exactness(spec),
            compute_class=compute_class,
        )

    @property
    def pinned(self) -> bool:
        """A `class` job: its shards stay on one compute class."""
        return self.exactness == "class"

    @property
    def wanted_devices(self) -> int:
        """A device with no shard does nothing, so never more devices than shards."""
        return min(self.max_devices, self.shards)


@dataclass(frozen=True)
class RunningJob:
    """A running job as preemption sees it: its priority and the devices it holds."""

    id: str
    priority: int
    devices: frozenset[str] = field(default_factory=frozenset)
