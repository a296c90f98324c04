"""Device registration, reads, and the heartbeat body (see docs/contracts.md)."""

from __future__ import annotations

import datetime as dt
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    computed_field,
    field_validator,
)

from api.schemas.common import Labels, ReadModel, RequestModel, check_labels
from api.store import compute_class
from api.store.states import DeviceState

MAX_SAMPLES_PER_HEARTBEAT = 1000


class DeviceSpec(BaseModel):
    """Hardware facts; the known keys are typed, unknown keys are kept as sent."""

    model_config = ConfigDict(extra="allow")

    model: str | None = Field(default=None, max_length=200)
    soc: str | None = Field(default=None, max_length=200)
    cpu_cores: int | None = Field(default=None, ge=1, le=1024)
    ram_mb: int | None = Field(default=None, ge=1, le=10_000_000)
    clusters: list[Any] | None = None
    backends: list[str] | None = None


FACT_MAX = 64  # characters of one compute-class fact


class BlasFacts(BaseModel):
    """The BLAS numpy calls (threadpoolctl's view; null where the agent could not tell)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    library: str | None = Field(None, max_length=FACT_MAX, examples=["openblas"])
    version: str | None = Field(None, max_length=FACT_MAX, examples=["0.3.31"])
    kernel: str | None = Field(None, max_length=FACT_MAX, examples=["SkylakeX"])


class ComputeClass(BaseModel):
    """A machine's compute class (engine.compute_class.describe()): two devices whose `class`
    shards give the same bits share the fingerprint. Keys a later agent adds are ignored."""

    model_config = ConfigDict(strict=True, extra="ignore")

    machine: str = Field(max_length=FACT_MAX, examples=["aarch64"])
    numpy: str = Field(max_length=FACT_MAX, examples=["2.1.3"])
    blas: BlasFacts | None = None
    simd: str | None = Field(None, max_length=FACT_MAX, description="numpy's highest SIMD "
                             "feature", examples=["ASIMDHP"])
    simd_features: int = Field(ge=0, le=1024, description="how many numpy SIMD features "
                               "the CPU has")
    fingerprint: str = Field(pattern=compute_class.FINGERPRINT_PATTERN, description="16 "
                             "lowercase hex digits: the digest of a fixed shard computed with "
                             "the class kernels", examples=["be23673d0b4b503b"])


class Capabilities(BaseModel):
    """What the agent computes. `compute_class` is typed; the other keys (backends, archs,
    features) are kept as sent."""

    model_config = ConfigDict(extra="allow")

    compute_class: ComputeClass | None = None


class CapabilitiesRead(Capabilities):
    @field_validator("compute_class", mode="wrap")
    @classmethod
    def _as_stored(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        try:  # every stored one was checked at its heartbeat; one from before shows as null
            return handler(value)
        except ValidationError:
            return None


class DeviceRegister(RequestModel):
    enrollment_token: str = Field(min_length=1, max_length=200)
    name: str = Field(min_length=1, max_length=200)
    labels: Labels = Field(default_factory=dict)
    spec: DeviceSpec = Field(default_factory=DeviceSpec)


class DeviceTokenRotated(BaseModel):
    device_id: str
    device_token: str = Field(description="the new secret; shown only here, stored hashed")
    previous_token_expires_at: dt.datetime = Field(
        description="until when the token that asked still works (requests in flight)")


class DeviceRegistered(BaseModel):
    device_id: str
    device_token: str = Field(description="the secret; shown only here, stored hashed")
    name: str
    labels: dict[str, str]
    state: DeviceState
    heartbeat_interval_s: float
    lease_grace_s: float


class DeviceRead(ReadModel):
    id: str
    name: str
    state: DeviceState
    cordoned: bool
    draining: bool
    labels: dict[str, str]
    spec: dict[str, Any]
    pause_reason: str | None
    lease_renewed_at: dt.datetime | None
    agent_version: str | None
    upgrade_to: dict[str, Any] | None = Field(
        default=None, description="the agent build it was told to install, until it runs it")
    upgrade_failed: str | None = Field(
        default=None, description="the last agent version it could not install")
    capabilities: CapabilitiesRead
    profiles: dict[str, Any]
    latest_telemetry: dict[str, Any]
    latest_telemetry_at: dt.datetime | None
    created: dt.datetime

    @computed_field(description="its compute class in short: machine, BLAS library and "
                    "kernel, SIMD level, the fingerprint's first 8 digits; null when the agent "
                    "does not report one")  # type: ignore[prop-decorator]
    @property
    def compute_class(self) -> str | None:
        facts = self.capabilities.compute_class
        return compute_class.label(facts.model_dump()) if facts else None


class TelemetrySampleIn(RequestModel):
    ts: dt.datetime = Field(description="Unix seconds (float) or ISO 8601")
    battery_pct: float | None = Field(default=None, ge=0, le=100)
    charging: bool | None = None
    battery_temp_c: float | None = Field(default=None, ge=-50, le=200)
    cpu_temp_c: float | None = Field(default=None, ge=-50, le=200)
    power_w: float | None = Field(default=None, ge=-1000, le=1000)
    cpu_freq_mhz: float | None = Field(default=None, ge=0, le=100_000)
    throttled: bool | None = None
    busy: bool | None = None

    @field_validator("ts")
    @classmethod
    def _utc(cls, value: dt.datetime) -> dt.datetime:
        if value.tzinfo is None:
            return value.replace(tzinfo=dt.timezone.utc)
        return value.astimezone(dt.timezone.utc)


class Pause(RequestModel):
    reason: str = Field(min_length=1, max_length=40)
    detail: str | None = Field(default=None, max_length=1000)


class HeartbeatIn(RequestModel):
    telemetry: list[TelemetrySampleIn] = Field(max_length=MAX_SAMPLES_PER_HEARTBEAT)
    agent_version: str | None = Field(default=None, max_length=40)
    capabilities: Capabilities | None = None
    profiles: dict[str, Any] | None = None
    pause: Pause | None = None


class Lease(BaseModel):
    renewed_at: dt.datetime
    grace_s: float


class HeartbeatOut(BaseModel):
    device_id: str
    state: DeviceState
    lease: Lease
    heartbeat_interval_s: float
    commands: list[dict[str, Any]]


class TelemetrySampleRead(ReadModel):
    ts: dt.datetime
    battery_pct: float | None
    charging: bool | None
    battery_temp_c: float | None
    cpu_temp_c: float | None
    power_w: float | None
    cpu_freq_mhz: float | None
    throttled: bool | None
    busy: bool | None


class DevicePatch(RequestModel):
    """A JSON merge patch of a device's labels: a value sets the label, null removes it."""

    labels: dict[str, str | None] = Field(
        description="label -> new value, or null to remove it", examples=[{"rack": "b", "spare": None}])

    @field_validator("labels")
    @classmethod
    def _valid(cls, labels: dict[str, str | None]) -> dict[str, str | None]:
        check_labels({k: v or "" for k, v in labels.items()})
        return labels


class LogLine(BaseModel):
    model_config = ConfigDict(extra="forbid")

    seq: int = Field(ge=0, description="the agent's line counter: later lines, larger numbers")
    ts: float = Field(description="when it was logged, Unix seconds (the phone's clock)")
    level: str = Field(max_length=10)
    message: str = Field(max_length=4000)


class LogsIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lines: list[LogLine] = Field(max_length=1000)


class LogsRead(BaseModel):
    device_id: str
    requested_at: dt.datetime | None = Field(
        None, description="an operator's request not yet answered by the agent")
    shipped_at: dt.datetime | None = Field(None, description="when the lines below arrived")
    lines: list[LogLine] = []
