"""Device registration, reads, and the heartbeat body (see docs/contracts.md)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidatorFunctionWrapHandler,
    computed_field,
    field_validator,
    model_validator,
)

from api.schemas.common import Labels, ReadModel, RequestModel, check_labels
from domain.store import compute_class
from wire.states import DeviceState

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


NAME_PATTERN = r"^[\x21-\x7e]{1,64}$"  # 1-64 printable ASCII characters, no space
# a line of text: no control character (a NUL is no Postgres text; a newline forges lines)
LINE_PATTERN = r"^[^\x00-\x1f\x7f]*$"
Name = Annotated[str, Field(pattern=NAME_PATTERN, examples=["cnn"])]
MAX_NAMES = 64  # entries of each list of names (archs, backends, features) and of profiles
# samples/s of one phone for one arch: far above any phone (one x86 core computes ~1.8e6
# logreg samples/s); below it, a sum over any fleet is finite and no weight is NaN
MAX_SAMPLES_PER_S = 1e8


class Capabilities(BaseModel):
    """What the agent computes, every part typed and bounded (strict: a number where a list
    goes, or a list where a name goes, is a 422 naming the field). Keys a later agent adds are
    dropped: the server reads none of them, and a newer agent must still heartbeat."""

    model_config = ConfigDict(strict=True, extra="ignore")

    archs: list[Name] | None = Field(None, max_length=MAX_NAMES, description="the model archs "
                                     "it builds (`custom`: the job's own layer graph); null or "
                                     "absent: it did not say (any)")
    backends: list[Name] | None = Field(None, max_length=MAX_NAMES, examples=[["numpy"]])
    features: list[Name] | None = Field(None, max_length=MAX_NAMES, description="what it "
                                        "computes beyond an arch (augment, label_smoothing, "
                                        "upload_precision, portable, self_upgrade)")
    compute_class: ComputeClass | None = None


def _or_none(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    try:  # every stored value was checked at its heartbeat; one from before shows as null
        return handler(value)
    except ValidationError:
        return None


class CapabilitiesRead(Capabilities):
    """The stored capabilities as read: a part that is not what the heartbeat schema says (a
    row written before it said so) shows as null."""

    @model_validator(mode="before")
    @classmethod
    def _a_mapping(cls, value: Any) -> Any:
        return value if isinstance(value, Mapping) else {}

    @field_validator("archs", "backends", "features", "compute_class", mode="wrap")
    @classmethod
    def _as_stored(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        return _or_none(value, handler)


class Profile(BaseModel):
    """What the agent measured for one arch: its execution choice and its speed
    (`agent.runtime.execution.ExecutionManager.report`). Keys a later agent adds are dropped."""

    model_config = ConfigDict(strict=True, extra="ignore")

    samples_per_s: float | None = Field(None, gt=0, le=MAX_SAMPLES_PER_S, allow_inf_nan=False,
                                        description="training samples a second", examples=[812.0])
    threads: int | None = Field(None, ge=1, le=1024)
    cores: list[Annotated[int, Field(ge=0, le=4095)]] | None = Field(None, max_length=1024)
    backend: str | None = Field(None, max_length=FACT_MAX, pattern=LINE_PATTERN,
                                examples=["numpy"])
    core_set: str | None = Field(None, max_length=FACT_MAX, pattern=LINE_PATTERN,
                                 examples=["big"])
    pinned: bool | None = None
    power_w: float | None = Field(None, ge=-1000, le=1000, allow_inf_nan=False)


Profiles = Annotated[dict[Name, Profile], Field(max_length=MAX_NAMES)]
_NAME = TypeAdapter(Name)


def stored_profiles(value: Any) -> dict[str, Any]:
    """The stored profiles as read: an arch's entry that is not what the heartbeat schema says
    (a row written before it said so) is left out."""
    out: dict[str, Any] = {}
    for arch, profile in (value.items() if isinstance(value, Mapping) else ()):
        try:
            out[_NAME.validate_python(arch)] = Profile.model_validate(profile)
        except ValidationError:
            continue
    return out


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


def _stored_mapping(value: Any) -> Any:
    return value if isinstance(value, Mapping) else {}  # a JSON column holds any JSON


def _stored_labels(value: Any) -> dict[str, str]:
    return {k: v for k, v in _stored_mapping(value).items()
            if isinstance(k, str) and isinstance(v, str)}


StoredMapping = Annotated[dict[str, Any], BeforeValidator(_stored_mapping)]


class DeviceRead(ReadModel):
    id: str
    name: str
    state: DeviceState
    cordoned: bool
    draining: bool
    labels: Annotated[dict[str, str], BeforeValidator(_stored_labels)]
    spec: StoredMapping
    pause_reason: str | None
    lease_renewed_at: dt.datetime | None
    agent_version: str | None
    upgrade_to: dict[str, Any] | None = Field(
        default=None, description="the agent build it was told to install, until it runs it")
    upgrade_failed: str | None = Field(
        default=None, description="the last agent version it could not install")
    quarantine_reason: str | None = Field(
        default=None, description="why an audit quarantined it (cordoned until an admin "
        "uncordons it); null when not quarantined")
    capabilities: CapabilitiesRead
    profiles: Annotated[dict[str, Profile], BeforeValidator(stored_profiles)] = Field(
        description="per arch, what the agent measured")
    latest_telemetry: StoredMapping
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
    reason: str = Field(min_length=1, max_length=40, pattern=LINE_PATTERN)
    detail: str | None = Field(default=None, max_length=1000, pattern=LINE_PATTERN)


class HeartbeatIn(RequestModel):
    telemetry: list[TelemetrySampleIn] = Field(max_length=MAX_SAMPLES_PER_HEARTBEAT)
    agent_version: str | None = Field(default=None, max_length=40, pattern=LINE_PATTERN)
    capabilities: Capabilities | None = None
    profiles: Profiles | None = Field(None, description="per arch (at most 64), what the agent "
                                      "measured; replaces the stored profiles")
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

    seq: int = Field(ge=0, le=2**63 - 1, description="the agent's line counter: later "
                     "lines, larger numbers")
    ts: float = Field(allow_inf_nan=False, description="when it was logged, Unix seconds "
                      "(the phone's clock)")
    level: str = Field(max_length=10, pattern=LINE_PATTERN)
    message: str = Field(max_length=4000)


class LogsIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lines: list[LogLine] = Field(max_length=1000)


def _stored_lines(value: Any) -> list[Any]:
    """The stored lines as read: one shipped before LogLine said what it holds and not what it
    says now (a NaN time on SQLite) is left out."""
    out = []
    for line in value if isinstance(value, list) else []:
        try:
            out.append(LogLine.model_validate(line))
        except ValidationError:
            continue
    return out


class LogsRead(BaseModel):
    device_id: str
    requested_at: dt.datetime | None = Field(
        None, description="an operator's request not yet answered by the agent")
    shipped_at: dt.datetime | None = Field(None, description="when the lines below arrived")
    lines: Annotated[list[LogLine], BeforeValidator(_stored_lines)] = []
