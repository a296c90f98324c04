"""The store's tables (SQLAlchemy 2, typed). Alembic migrations in `migrations/` create them.

Every table has `created` and `updated`. JSON columns hold what is open-ended (labels, hardware
spec, job spec, metrics); everything a query filters or sorts on is a real column.
"""

from __future__ import annotations

import datetime as dt
import secrets
import uuid
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
    false,
    func,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column
from sqlalchemy.types import TypeDecorator

from wire.states import DeviceState, JobState

NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

# BigInteger autoincrement ids that also autoincrement on SQLite.
BigId = BigInteger().with_variant(Integer(), "sqlite")


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:16]}"


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.timezone.utc)


class UTCDateTime(TypeDecorator[dt.datetime]):
    """Timezone-aware on Postgres; SQLite drops the zone, so reads are re-tagged as UTC."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: dt.datetime | None, dialect: Any) -> dt.datetime | None:
        if value is not None and value.tzinfo is None:
            raise ValueError("naive datetime given to the store; use UTC-aware datetimes")
        return value

    def process_result_value(self, value: dt.datetime | None, dialect: Any) -> dt.datetime | None:
        if value is not None and value.tzinfo is None:
            return value.replace(tzinfo=dt.timezone.utc)
        return value


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {dt.datetime: UTCDateTime(), dict[str, Any]: JSON, list[Any]: JSON}

    created: Mapped[dt.datetime] = mapped_column(default=utcnow, server_default=func.now())
    updated: Mapped[dt.datetime] = mapped_column(
        default=utcnow, onupdate=utcnow, server_default=func.now()
    )


class Device(Base):
    __tablename__ = "devices"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("dev"))
    name: Mapped[str] = mapped_column(String(200), index=True)
    labels: Mapped[dict[str, Any]] = mapped_column(default=dict)
    spec: Mapped[dict[str, Any]] = mapped_column(default=dict)
    # Ready | NotReady | Cordoned | Draining (NotReady wins over the admin flags when shown)
    state: Mapped[str] = mapped_column(String(20), default=DeviceState.READY.value, index=True)
    cordoned: Mapped[bool] = mapped_column(Boolean, default=False)
    draining: Mapped[bool] = mapped_column(Boolean, default=False)
    # why the agent stopped taking steps (thermal | battery | busy), None while it trains
    pause_reason: Mapped[str | None] = mapped_column(String(40), default=None)
    # not indexed: every heartbeat rewrites it, and an index on it would make each of those
    # updates non-HOT (new entries in every index); the stale-lease scan reads the whole table
    lease_renewed_at: Mapped[dt.datetime | None] = mapped_column(default=None)
    agent_version: Mapped[str | None] = mapped_column(String(40), default=None)
    capabilities: Mapped[dict[str, Any]] = mapped_column(default=dict)
    # measured throughput per model: {"cnn": {"samples_per_s": .., "threads": .., "cores": [..]}}
    profiles: Mapped[dict[str, Any]] = mapped_column(default=dict)
    latest_telemetry: Mapped[dict[str, Any]] = mapped_column(default=dict)
    latest_telemetry_at: Mapped[dt.datetime | None] = mapped_column(default=None)
    # an operator asked for the agent's recent log lines: each heartbeat carries a `logs`
    # command until the agent ships them (device_logs), which clears it
    logs_requested_at: Mapped[dt.datetime | None] = mapped_column(default=None)
    # the agent build it was told to install ({"version", "sha256"}), until it heartbeats with
    # that version (scheduler.policy.upgrades); its heartbeats carry an `upgrade` command
    upgrade_to: Mapped[dict[str, Any] | None] = mapped_column(default=None)
    upgrade_started_at: Mapped[dt.datetime | None] = mapped_column(default=None)
    # the last version it could not install: not asked again until a rollout names another
    upgrade_failed: Mapped[str | None] = mapped_column(String(40), default=None)
    # why an audit found this device's result wrong (scheduler.audits): set with `cordoned`,
    # lifted with it by an admin's uncordon; None: not quarantined
    quarantine_reason: Mapped[str | None] = mapped_column(Text, default=None)


class AgentRollout(Base):
    """The agent build phones should run (one row, id 1, while a rollout is on)."""

    __tablename__ = "agent_rollouts"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    version: Mapped[str] = mapped_column(String(40))
    sha256: Mapped[str] = mapped_column(String(64))
    max_parallel: Mapped[int] = mapped_column(Integer)
    set_by: Mapped[str | None] = mapped_column(String(200), default=None)


class DeviceLog(Base):
    """The latest log lines a device's agent shipped on request (its bounded ring)."""

    __tablename__ = "device_logs"

    device_id: Mapped[str] = mapped_column(ForeignKey("devices.id", ondelete="CASCADE"),
                                           primary_key=True)
    shipped_at: Mapped[dt.datetime]
    lines: Mapped[list[Any]] = mapped_column(default=list)


class EnrollmentToken(Base):
    __tablename__ = "enrollment_tokens"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("enr"))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    expires_at: Mapped[dt.datetime]
    max_uses: Mapped[int | None] = mapped_column(Integer, default=None)
    uses: Mapped[int] = mapped_column(Integer, default=0)
    revoked: Mapped[bool] = mapped_column(Boolean, default=False)
    # labels every device enrolled with this token starts with
    labels: Mapped[dict[str, Any]] = mapped_column(default=dict)
    description: Mapped[str | None] = mapped_column(String(200), default=None)


class ApiToken(Base):
    """Bearer tokens of kind admin, user or device; only the SHA-256 of the secret is kept."""

    __tablename__ = "api_tokens"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("tok"))
    kind: Mapped[str] = mapped_column(String(10))  # admin | user | device
    name: Mapped[str | None] = mapped_column(String(200), default=None)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    device_id: Mapped[str | None] = mapped_column(
        ForeignKey("devices.id", ondelete="CASCADE"), default=None, index=True
    )
    revoked: Mapped[bool] = mapped_column(Boolean, default=False)
    expires_at: Mapped[dt.datetime | None] = mapped_column(default=None)


class TelemetrySample(Base):
    __tablename__ = "telemetry_samples"
    # ts only for pruning: BRIN on Postgres (tiny, nearly free to maintain for ascending ts)
    __table_args__ = (Index("ix_telemetry_device_ts", "device_id", "ts"),
                      Index("ix_telemetry_ts_brin", "ts", postgresql_using="brin"))

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    device_id: Mapped[str] = mapped_column(ForeignKey("devices.id", ondelete="CASCADE"))
    ts: Mapped[dt.datetime]
    battery_pct: Mapped[float | None] = mapped_column(Float, default=None)
    charging: Mapped[bool | None] = mapped_column(Boolean, default=None)
    battery_temp_c: Mapped[float | None] = mapped_column(Float, default=None)
    cpu_temp_c: Mapped[float | None] = mapped_column(Float, default=None)
    power_w: Mapped[float | None] = mapped_column(Float, default=None)
    cpu_freq_mhz: Mapped[float | None] = mapped_column(Float, default=None)
    throttled: Mapped[bool | None] = mapped_column(Boolean, default=None)
    busy: Mapped[bool | None] = mapped_column(Boolean, default=None)


class Job(Base):
    __tablename__ = "jobs"

    id: Mapped[str] = mapped_column(String(40), primary_key=True, default=lambda: new_id("job"))
    name: Mapped[str] = mapped_column(String(200))
    spec: Mapped[dict[str, Any]] = mapped_column(default=dict)
    # Pending | Running | Succeeded | Failed | Cancelled
    state: Mapped[str] = mapped_column(String(20), default=JobState.PENDING.value, index=True)
    reason: Mapped[str | None] = mapped_column(Text, default=None)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    # the next step to compute: weights of step `step` exist, `step` steps have been applied
    step: Mapped[int] = mapped_column(Integer, default=0)
    total_steps: Mapped[int] = mapped_column(Integer, default=0)
    metrics: Mapped[dict[str, Any]] = mapped_column(default=dict)
    owner_token_id: Mapped[str | None] = mapped_column(String(40), default=None)
    # the user (their token's id) who sees, cancels and is limited by this job; None: an admin's
    owner: Mapped[str | None] = mapped_column(String(200), default=None, index=True)
    # names the hot state of `step` (hotstate.keys.state): written by the apply or restore whose
    # commit set it, so a losing applier's state, written under its own nonce, is never read
    state_nonce: Mapped[str | None] = mapped_column(String(32), default=None)
    # engine.plan's estimate at submit (parameters, FLOPs, memory per phone); placement keeps
    # the job off phones without the memory. None: submitted before plans
    plan: Mapped[dict[str, Any] | None] = mapped_column(default=None)
    # a `class` job's compute class (the fingerprint of engine.compute_class), chosen at its
    # first placement: its shards stay on devices that report it. None: portable, or not placed
    compute_class: Mapped[str | None] = mapped_column(String(16), default=None)
    started_at: Mapped[dt.datetime | None] = mapped_column(default=None)
    finished_at: Mapped[dt.datetime | None] = mapped_column(default=None)
    # when the current step's work was handed out (stall and straggler detection)
    step_started_at: Mapped[dt.datetime | None] = mapped_column(default=None)
    # the secret the audit draw is keyed with (scheduler.policy.audit.drawn): never shown to a
    # phone, so none can tell which of its nodes are audited. None: a job from before audits
    # (its id stands in)
    audit_key: Mapped[str | None] = mapped_column(String(32), default=lambda: secrets.token_hex(16))


class ShardAssignment(Base):
    """Shard `shard` of a job, held by a device from `since_step` on.

    role "primary" is the owner; "backup" is a straggler's second copy (first upload wins);
    "audit" and "decide" (scheduler.audits) are one row per audited node of step `since_step`,
    shards `shard`..`shard + span - 1`, computed again by a second (and, when the two differ,
    a third) device and stored apart from the holder's result.
    """

    __tablename__ = "shard_assignments"
    __table_args__ = (UniqueConstraint("job_id", "shard", "role", name="uq_shard_role"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    shard: Mapped[int] = mapped_column(Integer)
    device_id: Mapped[str] = mapped_column(
        ForeignKey("devices.id", ondelete="CASCADE"), index=True
    )
    role: Mapped[str] = mapped_column(String(10), default="primary")
    since_step: Mapped[int] = mapped_column(Integer, default=0)
    span: Mapped[int] = mapped_column(Integer, default=1, server_default="1")


class AuditRecord(Base):
    """What audits know of one device in one job: how many of its steps were audited in full
    and agreed (its probation: scheduler.policy.audit.on_probation), and the first step whose
    applied state holds a result of it that no audit checked (where a rewind must go back to
    when it is found lying; None: every result of it in the state was audited)."""

    __tablename__ = "audit_records"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"),
                                        primary_key=True)
    device_id: Mapped[str] = mapped_column(String(40), primary_key=True)
    verified_steps: Mapped[int] = mapped_column(Integer, default=0)
    first_unaudited_step: Mapped[int | None] = mapped_column(Integer, default=None)


class Event(Base):
    """A recorded state change, Kubernetes-style: about a job, a device, or both."""

    __tablename__ = "events"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    ts: Mapped[dt.datetime] = mapped_column(default=utcnow, index=True)
    job_id: Mapped[str | None] = mapped_column(
        ForeignKey("jobs.id", ondelete="CASCADE"), default=None, index=True
    )
    device_id: Mapped[str | None] = mapped_column(String(40), default=None, index=True)
    kind: Mapped[str] = mapped_column(String(10), default="Normal")  # Normal | Warning
    reason: Mapped[str] = mapped_column(String(60))  # e.g. NodeNotReady, Scheduled, ShardsMoved
    message: Mapped[str] = mapped_column(Text, default="")
    data: Mapped[dict[str, Any]] = mapped_column(default=dict)


class StepMetric(Base):
    __tablename__ = "step_metrics"

    job_id: Mapped[str] = mapped_column(
        ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True
    )
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    ts: Mapped[dt.datetime] = mapped_column(default=utcnow)
    epoch: Mapped[float] = mapped_column(Float, default=0.0)
    train_loss: Mapped[float | None] = mapped_column(Float, default=None)
    train_accuracy: Mapped[float | None] = mapped_column(Float, default=None)
    val_loss: Mapped[float | None] = mapped_column(Float, default=None)
    val_accuracy: Mapped[float | None] = mapped_column(Float, default=None)
    lr: Mapped[float | None] = mapped_column(Float, default=None)
    samples: Mapped[int] = mapped_column(Integer, default=0)
    step_seconds: Mapped[float | None] = mapped_column(Float, default=None)
    devices: Mapped[int] = mapped_column(Integer, default=0)
    energy_j: Mapped[float | None] = mapped_column(Float, default=None)


class Checkpoint(Base):
    __tablename__ = "checkpoints"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    path: Mapped[str] = mapped_column(Text)
    sha256: Mapped[str] = mapped_column(String(64))
    size_bytes: Mapped[int] = mapped_column(BigInteger)


class Dataset(Base):
    """An uploaded dataset (built-ins such as `digits` are not rows). Owned (domain.store.owners):
    `owner` is the uploading user's token id, None for an admin's; `public` (set by an admin
    only) lets every user see and use it."""

    __tablename__ = "datasets"

    name: Mapped[str] = mapped_column(String(100), primary_key=True)
    path: Mapped[str] = mapped_column(Text)
    n_samples: Mapped[int] = mapped_column(Integer)
    input_shape: Mapped[list[Any]] = mapped_column(default=list)
    num_classes: Mapped[int] = mapped_column(Integer)
    sha256: Mapped[str] = mapped_column(String(64))
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    owner: Mapped[str | None] = mapped_column(String(200), default=None, index=True)
    public: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # what it takes on the server's disk, unpacked (what the per-user quota counts)
    stored_bytes: Mapped[int] = mapped_column(BigInteger, default=0, server_default="0")
