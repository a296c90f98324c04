"""Control-plane settings, read once from `PHALANX_*` environment variables.

Each field's `description` (and, where a default or a bound needs words, `json_schema_extra`'s
`default_text` and `bounds_text`) is what docs/deploy.md's settings table says of it:
`scripts/docs_tables.py` writes the table from this class, and a test fails when they differ.
"""

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
DAY_S = 24 * 3600.0


def _shown(default: str | None = None, bounds: str | None = None) -> dict[str, str]:
    """How the settings table shows a default or a bound that the field's value cannot say."""
    return {k: v for k, v in (("default_text", default), ("bounds_text", bounds)) if v}


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="PHALANX_", extra="ignore")

    database_url: str | None = Field(
        default=None, description="SQLAlchemy URL, e.g. "
        "`postgresql+psycopg://phalanx:PASSWORD@HOST:5432/phalanx`",
        json_schema_extra=_shown("unset: `sqlite:///<data dir>/phalanx.sqlite`"))
    redis_url: str | None = Field(
        default=None, description="Celery broker and hot blob store (weights, gradients), e.g. "
        "`redis://HOST:6379/0`", json_schema_extra=_shown("unset: embedded mode"))
    admin_token: SecretStr | None = Field(
        default=None, description=f"the admin bearer token; at least {MIN_ADMIN_TOKEN_CHARS} "
        "characters (`openssl rand -hex 32`): a shorter one (a placeholder left in a manifest) "
        "stops every command at start with one line, exit 2",
        json_schema_extra=_shown("unset: generated once, written to "
                                 "`$PHALANX_DATA_DIR/admin-token` (mode 0600, never logged), "
                                 "stored hashed", f"≥ {MIN_ADMIN_TOKEN_CHARS} characters"))
    data_dir: Path = Field(
        default_factory=_default_data_dir, description="SQLite file, checkpoints "
        "(`artifacts/<job>/step-<N>.npz`), uploaded datasets (`datasets/<name>.npz`), the agent "
        "release key (`agent-release.key`, made once, mode 0600: the key phones check upgrades "
        "against; every API replica must see the same one, and a lost one means reinstalling "
        "the phones: back it up)", json_schema_extra=_shown("`~/.local/share/phalanx`"))

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
    lease_grace_s: float = Field(40.0, gt=0, description="a device without a heartbeat for "
                                 "longer is `NotReady` (a lease exactly this old is still fresh)")
    heartbeat_interval_s: float = Field(10.0, gt=0, description="how often agents are told to "
                                        "heartbeat")
    # per device and API process: a phone's heartbeats past this rate are answered 429 with
    # Retry-After (the agent backs off); a burst covers reconnects and early state reports
    heartbeat_max_per_minute: float | None = Field(
        None, gt=0, description="heartbeats per device and API process, on average; past it a "
        "heartbeat is answered 429 with `Retry-After` (the agent backs off). Only heartbeats "
        "accepted with the device's own token count, so nobody else can use up a phone's rate")
    heartbeat_burst: int = Field(10, ge=1, description="heartbeats a device may send at once "
                                 "(reconnects, early state reports)")
    # device tokens are rotated without re-enrolment: a heartbeat tells an agent whose token is
    # older than this to get a new one (POST /v1/devices/{id}/token); the old one then works for
    # the grace period (requests in flight), and no longer
    device_token_max_age_s: float = Field(
        30 * DAY_S, gt=0, description="a device token older than this is rotated: the heartbeat "
        "answers `rotate_token`, the agent gets a new token (`POST /v1/devices/{id}/token`), "
        "saves it and uses it, without enrolling again")
    # long enough for a phone whose answer was lost and that then slept (Doze) to ask again
    device_token_rotation_grace_s: float = Field(
        DAY_S, ge=0, description="how long the replaced token still works (requests in flight, "
        "a crash before the agent saved the new one) for the device's ordinary calls; it can "
        "never rotate again (409): only the device's newest token rotates")
    # telemetry
    telemetry_retention_s: float = Field(
        7 * DAY_S, gt=0, description="telemetry samples older than this are deleted by "
        "reconcile (at most once every 60 s, by whichever worker runs it; compared with each "
        "sample's own `ts`); the latest sample stays on the device row")
    # history kept per job (newest first) and for devices; pruned by reconcile every 10 minutes
    events_kept_per_job: int = Field(10_000, ge=1, description="the newest events kept per job; "
                                     "older ones are deleted by reconcile (every 10 minutes)")
    step_metrics_kept_per_job: int = Field(100_000, ge=1, description="the newest step metrics "
                                           "(the loss curve's points) kept per job")
    device_event_retention_s: float = Field(30 * DAY_S, gt=0, description="how long events of "
                                            "devices (no job) are kept")
    # request limits
    max_body_bytes: int = Field(1 * 1024 * 1024, ge=1, description="request body limit")
    max_upload_bytes: int = Field(64 * 1024 * 1024, ge=1, description="body limit of dataset "
                                  "and gradient uploads")
    # a dataset sent by resumable upload (in chunks, kept on disk, read a few rows at a time:
    # the server's memory does not grow with it); also what any upload may unpack to
    max_dataset_bytes: int = Field(
        64 * 1024**3, ge=1, description="largest dataset file a resumable upload takes (kept on "
        "disk, read a chunk of rows at a time), and what any upload may unpack to")
    # enrollment tokens
    enrollment_token_ttl_s: float = Field(DAY_S, gt=0, description="default lifetime of an "
                                          "enrollment token")
    # scheduler
    reconcile_interval_s: float = Field(2.0, gt=0, description="beat's reconcile period")
    checkpoint_every_steps: int = Field(50, ge=1, description="fallback only: a job's "
                                        "`checkpoint_every` (default 50) applies")
    # a phone told to install a new agent that does not heartbeat with it in this time is
    # marked failed for that version (scheduler.policy.upgrades) and no longer counted in flight
    agent_upgrade_timeout_s: float = Field(
        600.0, gt=0, description="a phone told to install an agent rollout that does not "
        "heartbeat with it in this time is marked failed for that version (docs/agent.md, "
        "\"Upgrades\")")
    checkpoints_kept: int = Field(
        3, ge=1, description="checkpoints kept per job, newest first: each new one deletes the "
        "rows and then the files of older ones (a restore needs only the newest readable one)")
    # tenancy: what one user's jobs may hold at once (admins' jobs are not limited); a job over a
    # limit waits Pending with the reason
    user_max_running_jobs: int | None = Field(
        None, ge=1, description="running jobs per user (a user: one user token); a job over it "
        "waits Pending with the reason, and never preempts its owner's jobs; admins' jobs are "
        "not limited", json_schema_extra=_shown("unset (no limit)"))
    user_max_devices: int | None = Field(
        None, ge=1, description="devices one user's running jobs hold together: a job gets at "
        "most what is left, and waits Pending when that is below its `min_devices`",
        json_schema_extra=_shown("unset (no limit)"))
    # bytes one user's datasets take on the server's disk, unpacked, all together; an upload
    # past it is 413 (admins' uploads are not limited)
    user_max_dataset_bytes: int | None = Field(
        None, ge=1, description="bytes one user's datasets may take on the server's disk "
        "together, counted unpacked (`stored_bytes`); an upload past it is 413 naming it, "
        "before anything is unpacked when the `.npz` says so; admins' uploads are not counted "
        "(docs/api.md, \"Datasets\"). Set it wherever users are not all trusted: each may "
        "otherwise fill the data folder", json_schema_extra=_shown("unset (no limit)"))
    work_long_poll_max_s: float = Field(30.0, ge=0, description="cap on "
                                        "`GET /v1/devices/{id}/work?wait=`")
    # how long a Python thread of the server may hold the GIL while others wait (CPython's
    # default is 5 ms): the step's data-plane threads wake for every socket read and write
    gil_switch_interval_s: float = Field(
        0.001, gt=0, le=0.1, description="the server's GIL switch interval (CPython's default "
        "5 ms); set by `phalanx server`, each uvicorn worker and `phalanx worker`")
    buffer_pool_mb: int = Field(
        4096, ge=0, description="MiB of model-sized buffers (uploads received, states and "
        "weights messages made) a server or worker keeps to hand out again, instead of the "
        "kernel faulting in and zeroing fresh pages every step (`wire/buffers.py`); a buffer is "
        "reused only once nothing references it, and one not handed out for 60 s is let go. A "
        "step needs about (phones on this replica + 4) x the model's bytes (8 phones of "
        "resnet50: ~1.2 GB; the pod's memory limit must allow that working set anyway, and the "
        "pool adds up to ~20% to a replica's peak in Redis mode: docs/benchmarks.md); `0`: none "
        "kept. `deploy/k8s/configmap.yaml` sets 768: the API pod's two processes stay under its "
        "2 GiB limit (tested); raise both for big models. These processes also start glibc's "
        "malloc with `mmap_threshold=32 MiB` and `trim_threshold=64 MiB` (`engine/memory.py`; "
        "an operator's own `GLIBC_TUNABLES` win per name)")
    # the step's bulk transfers on their own port (api.steps.bulk_listener); `phalanx server` sets these
    bulk_port: int | None = Field(
        default=None, ge=0, le=65535, description="the bulk listener (weights down, gradient "
        "uploads up, a thread per connection: `api/steps/bulk_listener.py`); agents are told it "
        "in their assignment and fall back to the API port when it does not answer. Open it "
        "wherever the API port is open",
        json_schema_extra=_shown("`phalanx server`: `--bulk-port`, default API port + 1 "
                                 "(`0`: off)"))
    bulk_host: str = Field("127.0.0.1", description="the interface the bulk listener binds",
                           json_schema_extra=_shown("`phalanx server`: its `--host`"))
    bulk_public_url: str | None = Field(
        default=None, description="the bulk listener's URL as agents reach it (behind a proxy, "
        "NAT or TLS terminator)", json_schema_extra=_shown(
            "unset: the host an agent used for the API, on the bulk port, plain http only"))
    bulk_reuse_port: bool = Field(
        False, description="several uvicorn worker processes share the bulk port "
        "(SO_REUSEPORT)", json_schema_extra=_shown("`phalanx server`: on with `--workers` > 1 "
                                                   "and Redis"))
    # the kernel's send and receive buffers of each bulk connection (it doubles the figure);
    # 0: the kernel's autotuning. 256 KiB moved a step's 8 x 12.9 MB each way on loopback with
    # ~0.9x the CPU of autotuning (bench/socket_buffers.py); raise it, or use 0, for links whose
    # bandwidth-delay product is larger (10 Gbit/s over more than ~0.4 ms)
    bulk_socket_buffer_bytes: int = Field(
        DEFAULT_SOCKET_BUFFER_BYTES, ge=0, le=64 * 1024 * 1024, description="kernel send and "
        "receive buffers of each bulk connection (the kernel doubles the figure; `0`: the "
        "kernel's autotuning). 256 KiB moved a step's transfers with ~0.9x the CPU of "
        "autotuning on loopback (`bench/socket_buffers.py`); raise it or use `0` for links with "
        "a larger bandwidth-delay product (10 Gbit/s over more than ~0.4 ms)")
    # what one client may hold of the bulk listener (api.steps.bulk_listener.Bounds)
    bulk_max_connections: int = Field(
        1024, ge=1, description="connections the bulk listener serves at once (a thread each); "
        "more are closed at once, counted in "
        "`phalanx_bulk_refused_connections_total{reason=\"max_connections\"}`")
    bulk_header_timeout_s: float = Field(
        30.0, gt=0, description="a request's headers must arrive within this, and a kept-alive "
        "connection may wait this long for its next request (agents reconnect)")
    bulk_stall_s: float = Field(
        10.0, gt=0, description="each MiB of an upload or of a weights answer must move within "
        "this (at least ~100 KiB/s): a trickled body is cut and frees its slot")
    bulk_bodies_per_device: int = Field(
        2, ge=1, description="upload bodies one device may have in flight; more are answered "
        "429 before their body is read (agents retry with backoff)")

    # production: upload bodies stay on the replica that received them, read by the step's
    # applier from this port (api.steps.peer_listener, hotstate.bodies)
    peer_port: int = Field(
        0, ge=-1, le=65535, description="production: the replica's peer port, where the step's "
        "applier reads the upload bodies this replica keeps (`api/steps/peer_listener.py`, "
        "`hotstate/bodies.py`); `-1`: off, bodies go through Redis. Workers and the other "
        "replicas must reach it; phones never use it", json_schema_extra=_shown(
            "0 (any free port)"))
    peer_host: str | None = Field(
        None, description="the address the peer port binds and is advertised at",
        json_schema_extra=_shown("this host's name, resolved (the pod's or container's "
                                 "address)"))
    apply_on_replica: bool = Field(
        True, description="a replica applies the steps whose last upload it received (same "
        "task, one thread; `scheduler/local_apply.py`); `false`: the workers apply every step")
    peer_shelf_bytes: int = Field(
        2 * 1024**3, ge=0, description="upload bodies one replica process keeps at most; past "
        "it, bodies go through Redis")

    # TLS for the API port and the bulk port (`phalanx server --tls-cert/--tls-key`): PEM files;
    # the peer port between replicas stays plain (upload bodies, no tokens)
    tls_cert_file: Path | None = Field(
        None, description="PEM certificate (chain) of the API and bulk ports "
        "(`phalanx server --tls-cert`)", json_schema_extra=_shown("unset: plain http"))
    tls_key_file: Path | None = Field(
        None, description="its PEM private key (`--tls-key`); both or neither")

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
