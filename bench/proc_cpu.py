"""CPU time and page faults of live processes from /proc (Linux): where a benchmark's work
went."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path


def _stats() -> Iterator[tuple[int, str, list[str]]]:
    """(pid, command name, the fields after the name in /proc/<pid>/stat) of every readable
    process."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            continue
        name, fields = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        yield int(pid), name, fields


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
