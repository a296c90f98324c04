"""CPU time and page faults of live processes from /proc (Linux): where a benchmark's work
went."""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from pathlib import Path


def _fields(pid: int | str) -> tuple[str, list[str]] | None:
    """(command name, the fields after the name in /proc/<pid>/stat), or None when gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()


def _stats() -> Iterator[tuple[int, str, list[str]]]:
    """(pid, command name, the fields after the name in /proc/<pid>/stat) of every readable
    process."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        if (read := _fields(pid)) is not None:
            yield int(pid), *read


def process_cpu() -> Iterator[tuple[int, str, float]]:
    """(pid, command name, user + system seconds so far) for every readable process."""
    tick = os.sysconf("SC_CLK_TCK")
    for pid, name, fields in _stats():
        yield pid, name, (int(fields[11]) + int(fields[12])) / tick


def process_faults() -> Iterator[tuple[int, str, int]]:
    """(pid, command name, minor page faults so far) for every readable process: a process that
    keeps getting fresh memory from the kernel (a freed big block faulted in again) shows here."""
    for pid, name, fields in _stats():
        yield pid, name, int(fields[7])


def process_peak_rss() -> Iterator[tuple[int, str, int]]:
    """(pid, command name, peak resident bytes so far: VmHWM) for every readable process."""
    for pid, name, _ in _stats():
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                yield pid, name, int(line.split()[1]) * 1024


def faults_of(pids: Iterable[int]) -> int:
    """Minor page faults so far of these processes together (those gone count nothing)."""
    return sum(int(read[1][7]) for read in map(_fields, pids) if read is not None)
