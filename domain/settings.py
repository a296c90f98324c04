"""Control-plane settings, read once from `PHALANX_*` environment variables."""

from __future__ import annotations

import ssl
from functools import lru_cache
from pathlib import Path

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from wire.sockopts import DEFAULT_SOCKET_BUFFER_BYTES


def _default_data_dir() -> Path:
    return Path.home() / ".local" / "share" / "phalanx"


MIN_ADMIN_TOKEN_CHARS = 32


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PHALANX_", extra="ignore")

    database_url: str | None = Field(
        default=None, description="SQLAlchemy URL; unset means a SQLite file in data_dir"
    )
    redis_url: str | None = Field(
        default=None, description="Celery broker and hot blob store; unset means embedded"
    )
    admin_token: SecretStr | None = Field(
        default=None, description="admin bearer token, at least 32 characters (openssl rand "
        "-hex 32); generated, printed once and stored hashed when unset"
    )
    data_dir: Path = Field(default_factory=_default_data_dir)

    @field_validator("admin_token")
    @classmethod
    def _strong_admin_token(cls, value: SecretStr | None) -> SecretStr | None:
        # a guessable admin token (a placeholder left in a manifest, "admin") is refused at
        # start rather than served; generated tokens are 43 characters of 32 random bytes
        if value is not None and len(value.get_secret_value().strip()) < MIN_ADMIN_TOKEN_CHARS:
            raise ValueError(f"must be at least {MIN_ADMIN_TOKEN_CHARS} "
                             "characters: make one with `openssl rand -hex 32`")
        return value

    # node lifecycle
    lease_grace_s: float = 40.0
    heartbeat_interval_s: float = 10.0
    # per device and API process: a phone's heartbeats past this rate are answered 429 with
    # Retry-After (the agent backs off); a burst covers reconnects and early state reports
    heartbeat_max_per_minute: float | None = Field(None, gt=0, description="heartbeats per "
                                                   "device and minute, on average; unset: 4x "
                                                   "what heartbeat_interval_s asks for")
    heartbeat_burst: int = Field(10, ge=1, description="heartbeats a device may send at once")
    # device tokens are rotated without re-enrolment: a heartbeat tells an agent whose token is
    # older than this to get a new one (POST /v1/devices/{id}/token); the old one then works for
    # the grace period (requests in flight), and no longer
    device_token_max_age_s: float = Field(30 * 24 * 3600.0, gt=0)
    # long enough for a phone whose answer was lost and that then slept (Doze) to ask again
    device_token_rotation_grace_s: float = Field(24 * 3600.0, ge=0)
    # telemetry
    telemetry_retention_s: float = 7 * 24 * 3600.0
    # history kept per job (newest first) and for devices; pruned by reconcile once a minute
    events_kept_per_job: int = Field(10_000, ge=1, description="newest events kept per job")
    step_metrics_kept_per_job: int = Field(100_000, ge=1, description="newest step metrics "
                                           "kept per job (the loss curve)")
    device_event_retention_s: float = Field(30 * 24 * 3600.0, gt=0, description="how long "
                                            "events of devices (no job) are kept")
    # request limits
    max_body_bytes: int = 1 * 1024 * 1024
    max_upload_bytes: int = 64 * 1024 * 1024
    # a dataset sent by resumable upload (in chunks, kept on disk, read a few rows at a time:
    # the server's memory does not grow with it); also what any upload may unpack to
    max_dataset_bytes: int = Field(64 * 1024**3, ge=1, description="largest dataset file a "
                                   "resumable upload takes, and what any upload unpacks to")
    # enrollment tokens
    enrollment_token_ttl_s: float = 24 * 3600.0
    # scheduler
    reconcile_interval_s: float = 2.0
    checkpoint_every_steps: int = 50
    # a phone told to install a new agent that does not heartbeat with it in this time is
    # marked failed for that version (scheduler.policy.upgrades) and no longer counted in flight
    agent_upgrade_timeout_s: float = Field(600.0, gt=0, description="how long a phone may take "
                                           "to install an agent rollout and come back")
    checkpoints_kept: int = Field(3, ge=1, description="checkpoints kept per job, newest first; "
                                  "older files and rows are deleted as new ones are written")
    # tenancy: what one user's jobs may hold at once (admins' jobs are not limited); a job over a
    # limit waits Pending with the reason
    user_max_running_jobs: int | None = Field(None, ge=1, description="running jobs per user")
    user_max_devices: int | None = Field(None, ge=1, description="devices held by one user's "
                                         "running jobs together")
    # bytes one user's datasets take on the server's disk, unpacked, all together; an upload
    # past it is 413 (admins' uploads are not limited)
    user_max_dataset_bytes: int | None = Field(None, ge=1, description="bytes one user's "
                                               "datasets may take on disk, unpacked")
    work_long_poll_max_s: float = 30.0
    # how long a Python thread of the server may hold the GIL while others wait (CPython's
    # default is 5 ms): the step's data-plane threads wake for every socket read and write
    gil_switch_interval_s: float = Field(0.001, gt=0, le=0.1)
    buffer_pool_mb: int = Field(
        4096, ge=0, description="MiB of model-sized buffers (uploads, states, weights messages) a "
        "server or worker keeps to hand out again instead of faulting in fresh pages (wire.buffers); "
        "0: none kept")
    # the step's bulk transfers on their own port (api.steps.bulk_listener); `phalanx server` sets these
    bulk_port: int | None = Field(
        default=None, description="port for weights and gradient uploads; unset: API port only")
    bulk_host: str = "127.0.0.1"
    bulk_public_url: str | None = Field(
        default=None, description="the listener's base URL as agents reach it (proxy, NAT); "
        "default: the host an agent used for the API, on bulk_port, plain http agents only")
    bulk_reuse_port: bool = False  # several worker processes share the port (SO_REUSEPORT)
    # the kernel's send and receive buffers of each bulk connection (it doubles the figure);
    # 0: the kernel's autotuning. 256 KiB moved a step's 8 x 12.9 MB each way on loopback with
    # ~0.9x the CPU of autotuning (bench/socket_buffers.py); raise it, or use 0, for links whose
    # bandwidth-delay product is larger (10 Gbit/s over more than ~0.4 ms)
    bulk_socket_buffer_bytes: int = Field(DEFAULT_SOCKET_BUFFER_BYTES, ge=0, le=64 * 1024 * 1024)
    # what one client may hold of the bulk listener (api.steps.bulk_listener.Bounds)
    bulk_max_connections: int = Field(1024, ge=1, description="connections the bulk listener "
                                      "serves at once (a thread each); more are closed at once")
    bulk_header_timeout_s: float = Field(30.0, gt=0, description="a request's headers, or the "
                                         "wait for the next one on a kept-alive connection")
    bulk_stall_s: float = Field(10.0, gt=0, description="each MiB of an upload or a weights "
                                "answer must move within this")
    bulk_bodies_per_device: int = Field(2, ge=1, description="upload bodies one device may "
                                        "have in flight; more are answered 429")

    # production: upload bodies stay on the replica that received them, read by the step's
    # applier from this port (api.steps.peer_listener, hotstate.bodies)
    peer_port: int = Field(0, ge=-1, le=65535, description="port for the replica's upload "
                           "bodies; 0: any free port; -1: off (bodies go through Redis)")
    peer_host: str | None = Field(None, description="address workers and other replicas reach "
                                  "this replica at; default: this host's name, resolved")
    apply_on_replica: bool = Field(True, description="a replica applies the steps it "
                                   "completes (scheduler.local_apply); false: workers only")
    peer_shelf_bytes: int = Field(2 * 1024**3, ge=0, description="upload bodies a replica keeps "
                                  "at most; past it they go through Redis")

    # TLS for the API port and the bulk port (`phalanx server --tls-cert/--tls-key`): PEM files;
    # the peer port between replicas stays plain (upload bodies, no tokens)
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None

    @model_validator(mode="after")
    def _tls_pair(self) -> Settings:
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ValueError("TLS needs both PHALANX_TLS_CERT_FILE and PHALANX_TLS_KEY_FILE")
        for path in (self.tls_cert_file, self.tls_key_file):
            if path is not None and not path.is_file():
                raise ValueError(f"TLS file {path} does not exist")
        return self

    def tls_context(self) -> ssl.SSLContext | None:
        """The server side's TLS context, or None when TLS is off."""
        if self.tls_cert_file is None or self.tls_key_file is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.tls_cert_file, self.tls_key_file)
        return context

    @property
    def heartbeat_rate_per_minute(self) -> float:
        return self.heartbeat_max_per_minute or 4 * 60.0 / self.heartbeat_interval_s

    @property
    def resolved_database_url(self) -> str:
        if self.database_url:
            return self.database_url
        self.data_dir.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{self.data_dir / 'phalanx.sqlite'}"

    @property
    def admin_token_file(self) -> Path:
        """Where a generated admin token is written (mode 0600), once."""
        return self.data_dir / "admin-token"

    @property
    def artifacts_dir(self) -> Path:
        return self.data_dir / "artifacts"

    @property
    def embedded(self) -> bool:
        return self.redis_url is None


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
