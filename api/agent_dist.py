"""The phone agent as the control plane serves it: its sources as a pip-installable archive.

Phones install the agent with `curl SERVER/install.sh | bash -s -- --server SERVER --token T`;
the script pip-installs `SERVER/agent.tar.gz`. The archive is built from the `agent`, `engine` and
`wire` packages this server runs (sources, the agent's `pyproject.toml`, data files), so phones get the agent that matches their
control plane. Entries are sorted with fixed times: the same sources (and release key) give the
same bytes.

Releases are signed (agent/release.py): the server's Ed25519 key lives in its data folder
(`agent-release.key`, made once, mode 0600; every replica sharing the folder shares it), its
public half goes into the archive as `agent/release_key.json` (so the install line's sha256
pins it too), and each served build's signature goes out with the archive.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import secrets
import tarfile
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import agent
import engine
import wire
from agent import ed25519, release

SKIP_DIRS = {"__pycache__", ".pytest_cache", "build", "dist"}
SKIP_SUFFIXES = (".pyc", ".pyo", ".egg-info")
# agent/pyproject.toml maps the engine and the wire format from a checkout's sibling folders;
# in the archive the three packages are folders beside pyproject.toml, setuptools' default
CHECKOUT_LAYOUT = 'package-dir = {"agent" = ".", "engine" = "../engine", "wire" = "../wire"}\n'
KEY_FILE = "agent-release.key"  # in PHALANX_DATA_DIR: the release key's private half, hex


def agent_root() -> Path:
    return Path(agent.__file__).resolve().parent


def package_roots() -> dict[str, Path]:
    """The folders of the packages a phone installs: the agent, the engine and the wire format
    this server runs."""
    return {m.__name__: Path(m.__file__).resolve().parent for m in (agent, engine, wire)}


def _files(root: Path) -> list[Path]:
    out = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if any(part in SKIP_DIRS or part.endswith(SKIP_SUFFIXES) for part in rel.parts):
            continue
        if path.is_file():
            out.append(path)
    return out


def phone_project(agent_dir: Path) -> bytes:
    """agent/pyproject.toml for the archive's layout."""
    text = (agent_dir / "pyproject.toml").read_text()
    if CHECKOUT_LAYOUT not in text:
        raise ValueError(f"{agent_dir}/pyproject.toml: no `{CHECKOUT_LAYOUT.strip()}` line")
    return text.replace(CHECKOUT_LAYOUT, "").encode()


def build_archive(roots: dict[str, Path], version: str, release_key: bytes | None = None) -> bytes:
    """A .tar.gz with one top folder `phalanx-agent-<version>/` holding the phone's project:
    pyproject.toml and a folder per package of `roots` (name -> source folder).
    `release_key`: the public key phones installing it will trust for their upgrades, as
    `agent/release_key.json` (a copy in the sources is never served)."""
    if not (roots["agent"] / "pyproject.toml").is_file():
        raise FileNotFoundError(f"{roots['agent']}/pyproject.toml: the agent's project file is "
                                "not installed")
    top = f"phalanx-agent-{version}"
    entries = [(f"{top}/pyproject.toml", phone_project(roots["agent"]), 0o644)]
    for name, root in sorted(roots.items()):
        for path in _files(root):
            if name == "agent" and path.parent == root and path.name in (
                    "pyproject.toml", release.KEY_FILE):
                continue
            mode = 0o755 if path.suffix == ".sh" else 0o644
            entries.append((f"{top}/{name}/{path.relative_to(root).as_posix()}",
                            path.read_bytes(), mode))
    if release_key is not None:
        entries.append((f"{top}/agent/{release.KEY_FILE}", release.key_document(release_key),
                        0o644))
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for arcname, data, mode in entries:
            info = tarfile.TarInfo(arcname)
            info.size, info.mtime, info.mode = len(data), 0, mode
            tar.addfile(info, io.BytesIO(data))
    return gzip.compress(raw.getvalue(), mtime=0)


@dataclass(frozen=True)
class ReleaseKey:
    """The server's release key: signs the builds it serves."""

    seed: bytes  # the private half: never leaves the data folder
    public: bytes

    @classmethod
    def from_seed(cls, seed: bytes) -> ReleaseKey:
        return cls(seed, ed25519.public_key(seed))

    def sign(self, version: str, sha256: str) -> str:
        return ed25519.sign(self.seed, release.release_message(version, sha256)).hex()


def _read_key(path: Path) -> ReleaseKey:
    text = path.read_text().strip().lower()
    if len(text) != 64 or any(c not in "0123456789abcdef" for c in text):
        raise ValueError(f"{path}: not an agent release key (64 hex digits: the Ed25519 "
                         "private key); restore the right file, or delete it to make a new "
                         "key (phones then need reinstalling: they trust only the old one)")
    return ReleaseKey.from_seed(bytes.fromhex(text))


def load_release_key(data_dir: Path) -> ReleaseKey:
    """The key in `data_dir`, made there (mode 0600) the first time. Replicas starting
    together agree: the file appears whole, once (a hard link that fails when another
    replica's came first), and every process then reads the same one."""
    path = Path(data_dir) / KEY_FILE
    try:
        return _read_key(path)
    except FileNotFoundError:
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{KEY_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_bytes(32).hex() + "\n")
            fh.flush()
            os.fsync(fh.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another process made it first: theirs is the key
    finally:
        tmp.unlink(missing_ok=True)
    return _read_key(path)


@dataclass(frozen=True)
class ServedBuild:
    """The agent build this server serves: what a rollout pins and phones verify."""

    version: str
    sha256: str
    archive: bytes
    signature: str  # hex: the release key's signature of (version, sha256)
    public_key: str  # hex


@lru_cache(maxsize=4)
def _served(data_dir: str) -> ServedBuild:
    key = load_release_key(Path(data_dir))
    archive = build_archive(package_roots(), agent.__version__, key.public)
    sha256 = hashlib.sha256(archive).hexdigest()
    return ServedBuild(agent.__version__, sha256, archive, key.sign(agent.__version__, sha256),
                       key.public.hex())


def served(data_dir: Path) -> ServedBuild:
    """This server's agent build, signed with the release key of `data_dir` (built once)."""
    return _served(str(Path(data_dir).expanduser().resolve()))


def install_script() -> bytes:
    return (agent_root() / "install.sh").read_bytes()
