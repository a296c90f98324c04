"""The phone agent as the control plane serves it: its sources as a pip-installable archive.

Phones install the agent with `curl SERVER/install.sh | bash -s -- --server SERVER --token T`;
the script pip-installs `SERVER/agent.tar.gz`. The archive is built from the `agent` package this
server runs (sources, `pyproject.toml`, data files), so phones get the agent that matches their
control plane. Entries are sorted with fixed times: the same sources give the same bytes.
"""

from __future__ import annotations

import gzip
import io
import tarfile
from functools import lru_cache
from pathlib import Path

import agent

SKIP_DIRS = {"__pycache__", ".pytest_cache", "build", "dist"}
SKIP_SUFFIXES = (".pyc", ".pyo", ".egg-info")


def agent_root() -> Path:
    return Path(agent.__file__).resolve().parent


def _files(root: Path) -> list[Path]:
    out = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if any(part in SKIP_DIRS or part.endswith(SKIP_SUFFIXES) for part in rel.parts):
            continue
        if path.is_file():
            out.append(path)
    return out


def build_archive(root: Path, version: str) -> bytes:
    """A .tar.gz with one top folder `phalanx-agent-<version>/` holding the agent project."""
    if not (root / "pyproject.toml").is_file():
        raise FileNotFoundError(f"{root}/pyproject.toml: the agent's project file is not installed")
    top = f"phalanx-agent-{version}"
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for path in _files(root):
            data = path.read_bytes()
            info = tarfile.TarInfo(f"{top}/{path.relative_to(root).as_posix()}")
            info.size, info.mtime = len(data), 0
            info.mode = 0o755 if path.suffix == ".sh" else 0o644
            tar.addfile(info, io.BytesIO(data))
    return gzip.compress(raw.getvalue(), mtime=0)


@lru_cache(maxsize=1)
def served_archive() -> bytes:
    return build_archive(agent_root(), agent.__version__)


def install_script() -> bytes:
    return (agent_root() / "install.sh").read_bytes()
