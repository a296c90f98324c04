"""`/proc/meminfo` in MB."""

from __future__ import annotations

from agent.probes.sysfs import SysfsRoot


def parse_meminfo(text: str | None) -> dict[str, int]:
    out: dict[str, int] = {}
    for line in (text or "").splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key.strip()] = int(parts[0]) // 1024  # the kernel writes kB
    return out


def read_memory(fs: SysfsRoot) -> dict[str, int]:
    info = parse_meminfo(fs.read_text("/proc/meminfo"))
    out = {}
    if "MemTotal" in info:
        out["ram_mb"] = info["MemTotal"]
    if "MemAvailable" in info:
        out["mem_available_mb"] = info["MemAvailable"]
    return out
