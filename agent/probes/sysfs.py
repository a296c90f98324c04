"""Tolerant reads of `/sys` and `/proc` under `PHALANX_SYSFS_ROOT`.

Every probe reads through `SysfsRoot`, so tests and simulated phones point the whole agent at a
fixture tree. A read that fails for any reason (missing, SELinux-denied, a directory where a file
should be, garbage) returns None: on an unrooted phone half of these paths are denied and the
agent must keep going with what it can see.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT_ENV = "PHALANX_SYSFS_ROOT"
_MAX_READ = 64 * 1024  # sysfs attributes are one page; never slurp a huge file by mistake


def default_root() -> Path:
    return Path(os.environ.get(ROOT_ENV) or "/")


class SysfsRoot:
    """Reads absolute kernel paths (`/sys/...`, `/proc/...`) below `root`."""

    def __init__(self, root: str | os.PathLike[str] | None = None) -> None:
        self.root = Path(root) if root is not None else default_root()

    @property
    def is_real(self) -> bool:
        """True when reading the machine's own kernel (psutil fallbacks only make sense then)."""
        return self.root.resolve() == Path("/")

    def path(self, abspath: str) -> Path:
        return self.root / abspath.lstrip("/")

    def read_text(self, abspath: str) -> str | None:
        try:
            with open(self.path(abspath), encoding="utf-8", errors="replace") as fh:
                text = fh.read(_MAX_READ)
        except (OSError, ValueError):
            return None
        text = text.strip()
        return text or None

    def read_int(self, abspath: str) -> int | None:
        text = self.read_text(abspath)
        if text is None:
            return None
        try:
            return int(text.split()[0])
        except (ValueError, IndexError):
            return None

    def listdir(self, abspath: str) -> list[str]:
        try:
            return sorted(os.listdir(self.path(abspath)))
        except OSError:
            return []


def parse_cpu_list(text: str | None) -> list[int]:
    """Parse the kernel's cpu list format (`0-3,6,8-9`); garbage gives []."""
    if not text:
        return []
    cpus: set[int] = set()
    for part in text.strip().split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not m:
            return []
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) else lo
        if hi < lo or hi - lo > 4096:
            return []
        cpus.update(range(lo, hi + 1))
    return sorted(cpus)


def natural_key(name: str) -> tuple[str, int]:
    m = re.match(r"(\D*)(\d+)$", name)
    return (m.group(1), int(m.group(2))) if m else (name, -1)
