"""The hardware spec sent at enrollment: what the scheduler needs to know about this phone."""

from __future__ import annotations

import importlib.util
import os
import platform
import shutil
import subprocess
from importlib import metadata
from typing import Any

from agent.probes import cpu, memory
from agent.probes.sysfs import SysfsRoot

GETPROP_KEYS = {
    "model": "ro.product.model",
    "manufacturer": "ro.product.manufacturer",
    "board": "ro.product.board",
    "platform": "ro.board.platform",
    "soc": "ro.soc.model",
    "android_version": "ro.build.version.release",
    "sdk": "ro.build.version.sdk",
}


def getprop(key: str, timeout_s: float = 3.0) -> str | None:
    exe = shutil.which("getprop")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, key], capture_output=True, timeout=timeout_s, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    value = out.stdout.decode("utf-8", errors="replace").strip()
    return value or None


def cpuinfo_facts(fs: SysfsRoot) -> dict[str, str]:
    """Model/board from /proc/cpuinfo when there is no getprop (Linux, some ARM boards)."""
    facts: dict[str, str] = {}
    for line in (fs.read_text("/proc/cpuinfo") or "").splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip().lower(), value.strip()
        if not value:
            continue
        if key == "hardware":
            facts.setdefault("board", value)
        elif key in ("model name", "model") and not value.isdigit():
            facts.setdefault("model", value)
        elif key == "cpu implementer":
            facts.setdefault("cpu_implementer", value)
    return facts


def backends() -> list[str]:
    found = ["numpy"]
    if importlib.util.find_spec("torch") is not None:  # never import torch here: seconds on a phone
        found.append("torch")
    return found


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def collect_spec(fs: SysfsRoot | None = None) -> dict[str, Any]:
    fs = fs or SysfsRoot()
    spec: dict[str, Any] = {}
    props = {name: getprop(key) for name, key in GETPROP_KEYS.items()}
    spec.update({k: v for k, v in props.items() if v})
    for key, value in cpuinfo_facts(fs).items():
        spec.setdefault(key, value)
    spec.setdefault("soc", spec.get("platform") or spec.get("board"))
    spec.setdefault("model", platform.node() or "unknown")
    cores = cpu.read_cores(fs)
    spec["clusters"] = cpu.clusters(cores)
    spec["cpu_cores"] = len(cores) or os.cpu_count() or 1
    spec.update({k: v for k, v in memory.read_memory(fs).items() if k == "ram_mb"})
    spec["kernel"] = fs.read_text("/proc/sys/kernel/osrelease") or platform.release()
    spec["machine"] = platform.machine()
    spec["python"] = platform.python_version()
    spec["numpy"] = _version("numpy")
    spec["torch"] = _version("torch")
    spec["backends"] = backends()
    return {k: v for k, v in spec.items() if v is not None}
