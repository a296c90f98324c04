"""The agent's config file: server, device identity, knobs. Written 0600, atomically.

Android may kill the agent at any instant, so every file it writes goes through
`atomic_write` (temp file in the same folder, fsync, rename): a reader sees the old file or the
new one, never half of one. Leftover temp files are ignored and cleaned on the next write.
A step's weights and results skip the fsync (their CRC-32 catches a file a power cut tore).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wire.sockopts import DEFAULT_SOCKET_BUFFER_BYTES

DEFAULT_PATH = Path("~/.config/phalanx-agent/config.json")


class ConfigError(Exception):
    """The config is missing or unusable; the message says what to do."""


def atomic_write(path: Path, data: bytes | memoryview | Sequence[memoryview], mode: int = 0o600,
                 durable: bool = True) -> None:
    """`data` in one piece, or in parts written one after the other (never joined first).
    `durable=False` skips the fsyncs, for files a reader checks or makes again after a crash
    (a step's weights and results, 10-100 MB a step): the rename still means a reader sees
    the old file or the whole new one while the phone stays up; after a power cut the file
    may be absent, short or torn, which its reader's CRC check notices."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as fh:
            for part in [data] if isinstance(data, (bytes, memoryview)) else data:
                fh.write(part)
            if durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if not durable:
        return
    with contextlib.suppress(OSError):  # make the rename itself durable
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def clean_temp_files(path: Path) -> None:
    """Remove the temp files a killed writer of `path` left behind (only that file's)."""
    with contextlib.suppress(OSError):
        for tmp in path.parent.glob(f".{path.name}.*.tmp"):
            with contextlib.suppress(OSError):
                tmp.unlink()


def _doc(text: str) -> dict[str, str]:
    """What docs/agent.md's config table says of a field (scripts/docs_tables.py writes it)."""
    return {"doc": text}


@dataclass
class AgentConfig:
    server: str = field(metadata=_doc("the control plane's URL, as `enroll` was given it"))
    device_id: str = field(metadata=_doc("this phone's id, from its enrollment"))
    device_token: str = field(metadata=_doc(
        "this phone's bearer token; replaced (and saved) when a heartbeat asks for a rotation"))
    name: str = field(default="", metadata=_doc("the name the phone enrolled with"))
    labels: dict[str, str] = field(default_factory=dict, metadata=_doc(
        "the labels the phone enrolled with"))
    state_dir: str = field(default="", metadata=_doc(
        "caches and the upload ledger; `\"\"`: beside the config file (`config.state`)"))
    heartbeat_interval_s: float = field(default=10.0, metadata=_doc(
        "how often the agent heartbeats until the server says otherwise (every heartbeat's "
        "answer does)"))
    telemetry_buffer: int = field(default=1000, metadata=_doc(
        "telemetry samples kept while offline; the oldest go first"))
    backends: list[str] | None = field(default=None, metadata=_doc(
        "restrict the execution choice, e.g. `[\"numpy\"]`; `null`: every installed backend"))
    power_limit_w: float | None = field(default=None, metadata=_doc(
        "prefer samples/J among the configurations that draw less than this; `null`: fastest"))
    shared_mode: bool = field(default=False, metadata=_doc(
        "this phone has a user: pause while it is busy even when the job says not to"))
    busy_quiet_s: float = field(default=30.0, metadata=_doc(
        "in shared mode, how long after the user's last activity training resumes"))
    termux_timeout_s: float = field(default=5.0, metadata=_doc(
        "how long a `termux-*` probe may take before it is killed with its process group"))
    request_timeout_s: float = field(default=30.0, metadata=_doc(
        "an HTTP request's timeout (long polls add their wait)"))
    work_wait_s: float = field(default=30.0, metadata=_doc(
        "long poll for work (the server holds it at most `PHALANX_WORK_LONG_POLL_MAX_S`)"))
    socket_buffer_bytes: int = field(default=DEFAULT_SOCKET_BUFFER_BYTES, metadata=_doc(
        "kernel buffers of the agent's plain-http connections, each way (the control plane's "
        "bulk listener uses the same); `0`: the kernel's autotuning"))
    ca_file: str = field(default="", metadata=_doc(
        "PEM CA that signed an https server's certificate; `\"\"`: the system's CAs"))
    cache_max_shard_bytes: int = field(default=2 << 30, metadata=_doc(
        "shard data kept on the phone: past it the least recently used shard files go, never "
        "one the current step needs; a shard that comes back is fetched again"))

    def state_path(self, config_path: Path) -> Path:
        if self.state_dir:
            return Path(self.state_dir).expanduser()
        return config_path.with_name(config_path.stem + ".state")

    def to_json(self) -> bytes:
        return (json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n").encode()

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> AgentConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        try:
            cfg = cls(**{k: v for k, v in data.items() if k in known})
        except TypeError as exc:
            raise ConfigError(f"config lacks a required field: {exc}") from None
        for key in ("server", "device_id", "device_token"):
            if not isinstance(getattr(cfg, key), str) or not getattr(cfg, key):
                raise ConfigError(f"config field {key!r} must be a non-empty string")
        return cfg


def resolve_path(path: str | os.PathLike[str] | None) -> Path:
    return Path(path or DEFAULT_PATH).expanduser()


def load(path: Path) -> AgentConfig:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"no config at {path}: run `phalanx-agent enroll` first") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc}") from None
    try:
        data = json.loads(raw)
    except ValueError:
        raise ConfigError(
            f"config {path} is not valid JSON (damaged?): enroll again with `phalanx-agent enroll`"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"config {path} is not a JSON object")
    return AgentConfig.from_dict(data)


def save(path: Path, cfg: AgentConfig) -> None:
    atomic_write(path, cfg.to_json(), mode=0o600)
    clean_temp_files(path)
