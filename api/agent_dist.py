"""The phone agent as the control plane serves it: its sources as a pip-installable archive.

Phones install the agent with `curl SERVER/install.sh | bash -s -- --server SERVER --token T`;
the script pip-installs `SERVER/agent.tar.gz`. The archive is built from the `agent`, `engine` and
`wire` packages this server runs (sources, the agent's `pyproject.toml`, data files), so phones get the agent that matches their
control plane. Entries are sorted with fixed times: the same sources give the same bytes.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import tarfile
from functools import lru_cache
from pathlib import Path

import agent
import engine
import wire

SKIP_DIRS = {"__pycache__", ".pytest_cache", "build", "dist"}
SKIP_SUFFIXES = (".pyc", ".pyo", ".egg-info")
# agent/pyproject.toml maps the engine and the wire format from a checkout's sibling folders;
# in the archive the three packages are folders beside pyproject.toml, setuptools' default
CHECKOUT_LAYOUT = 'package-dir = {"agent" = ".", "engine" = "../engine", "wire" = "../wire"}\n'


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


def build_archive(roots: dict[str, Path], version: str) -> bytes:
    """A .tar.gz with one top folder `phalanx-agent-<version>/` holding the phone's project:
    pyproject.toml and a folder per package of `roots` (name -> source folder)."""
    if not (roots["agent"] / "pyproject.toml").is_file():
        raise FileNotFoundError(f"{roots['agent']}/pyproject.toml: the agent's project file is "
                                "not installed")
    top = f"phalanx-agent-{version}"
    entries = [(f"{top}/pyproject.toml", phone_project(roots["agent"]), 0o644)]
    for name, root in sorted(roots.items()):
        for path in _files(root):
            if name == "agent" and path.name == "pyproject.toml" and path.parent == root:
                continue
            mode = 0o755 if path.suffix == ".sh" else 0o644
            entries.append((f"{top}/{name}/{path.relative_to(root).as_posix()}",
                            path.read_bytes(), mode))
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for arcname, data, mode in entries:
            info = tarfile.TarInfo(arcname)
            info.size, info.mtime, info.mode = len(data), 0, mode
            tar.addfile(info, io.BytesIO(data))
    return gzip.compress(raw.getvalue(), mtime=0)


@lru_cache(maxsize=1)
def served_archive() -> bytes:
    return build_archive(package_roots(), agent.__version__)


def install_script() -> bytes:
    return (agent_root() / "install.sh").read_bytes()


@lru_cache(maxsize=1)
def served_build() -> tuple[str, str]:
    """(version, sha256) of the archive this server serves: what a rollout pins."""
    return agent.__version__, hashlib.sha256(served_archive()).hexdigest()
