"""glibc's malloc and the model-sized arrays of a step: kept in the heap, not faulted in again.

glibc returns a freed block above its mmap threshold to the kernel at once and trims a heap's free
top past 128 KiB, so every step's big arrays came back as fresh, zeroed pages: a phone's worker
paid for each shard's activations and gradients again (27-31 ms a cnn shard instead of 23,
bench/phone_cores.py), and the server for the state and weights message of every step it applies
(clear_page ~5% of its CPU, ~2,400 page faults a step at 8 agents,
bench/scheduler_coordination.py). A process that handles them keeps blocks up to 32 MiB (glibc's
largest mmap threshold) in its heap and up to 64 MiB of a heap free. An operator's own
GLIBC_TUNABLES win where both name one. stdlib only: a phone's worker reads it before numpy.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import MutableMapping

MALLOC_TUNABLES = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=67108864"
# mallopt's names for the tunables (malloc.h): how a process already running sets them
_MALLOPT = {"glibc.malloc.mmap_threshold": -3, "glibc.malloc.trim_threshold": -1}


def _named(tunables: str | None) -> list[tuple[str, str]]:
    return [(t.split("=", 1)[0], t) for t in (tunables or "").split(":") if t]


def with_malloc_tunables(operators: str | None) -> str:
    """GLIBC_TUNABLES for a process to start: the operator's own, then ours they do not set."""
    theirs = _named(operators)
    named = {name for name, _ in theirs}
    return ":".join([t for _, t in theirs] + [t for name, t in _named(MALLOC_TUNABLES)
                                             if name not in named])


def keep_big_blocks(environ: MutableMapping[str, str] = os.environ) -> list[str]:
    """This process (glibc's mallopt; glibc read GLIBC_TUNABLES when it started) and the ones it
    starts (`environ`'s GLIBC_TUNABLES: uvicorn's worker processes) keep a step's arrays. Returns
    the tunables set here: none where the operator named them all or malloc is not glibc's."""
    operators = environ.get("GLIBC_TUNABLES")
    named = {name for name, _ in _named(operators)}
    environ["GLIBC_TUNABLES"] = with_malloc_tunables(operators)
    try:
        mallopt = ctypes.CDLL(None).mallopt  # glibc (and musl's, which ignores it)
    except (AttributeError, OSError):
        return []
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    applied = []
    for name, tunable in _named(MALLOC_TUNABLES):
        if name not in named and mallopt(_MALLOPT[name], int(tunable.split("=", 1)[1])) == 1:
            applied.append(tunable)
    return applied
