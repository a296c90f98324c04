"""glibc's malloc and the model-sized arrays of a step: kept in the heap, not faulted in again.

glibc returns a freed block above its mmap threshold to the kernel at once and trims a heap's free
top past 128 KiB, so every step's big arrays came back as fresh, zeroed pages: a phone's worker
paid for each shard's activations and gradients again (27-31 ms a cnn shard instead of 23,
bench/phone_cores.py), and the server for the state and weights message of every step it applies
(clear_page ~5% of its CPU, ~2,400 page faults a step at 8 agents,
bench/scheduler_coordination.py). A process that handles them keeps blocks up to 32 MiB (glibc's
largest mmap threshold) in its heap and up to 64 MiB of a heap free. An operator's own setting
wins where both name one (GLIBC_TUNABLES, or glibc's older MALLOC_MMAP_THRESHOLD_ and
MALLOC_TRIM_THRESHOLD_). stdlib only: a phone's worker reads it before numpy.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping, MutableMapping

MALLOC_TUNABLES = "glibc.malloc.mmap_threshold=33554432:glibc.malloc.trim_threshold=67108864"
# mallopt's names for the tunables (malloc.h): how a process already running sets them; and
# glibc's older variables for the same, which an operator may have set instead
_MALLOPT = {"glibc.malloc.mmap_threshold": -3, "glibc.malloc.trim_threshold": -1}
_OLD_NAMES = {"MALLOC_MMAP_THRESHOLD_": "glibc.malloc.mmap_threshold",
              "MALLOC_TRIM_THRESHOLD_": "glibc.malloc.trim_threshold"}


def _named(tunables: str | None) -> list[tuple[str, str]]:
    return [(t.split("=", 1)[0], t) for t in (tunables or "").split(":") if t]


def _ours_unset(environ: Mapping[str, str]) -> list[str]:
    """Our tunables that the operator set neither in GLIBC_TUNABLES nor by glibc's older
    variables (MALLOC_MMAP_THRESHOLD_, MALLOC_TRIM_THRESHOLD_)."""
    named = {name for name, _ in _named(environ.get("GLIBC_TUNABLES"))} | {
        tunable for old, tunable in _OLD_NAMES.items() if old in environ}
    return [t for name, t in _named(MALLOC_TUNABLES) if name not in named]


def with_malloc_tunables(environ: Mapping[str, str]) -> str:
    """GLIBC_TUNABLES for a process to start with `environ`: the operator's own, then ours."""
    theirs = [t for _, t in _named(environ.get("GLIBC_TUNABLES"))]
    return ":".join(theirs + _ours_unset(environ))


def keep_big_blocks(environ: MutableMapping[str, str] = os.environ) -> list[str]:
    """This process (glibc's mallopt; glibc read GLIBC_TUNABLES when it started) and the ones it
    starts (`environ`'s GLIBC_TUNABLES: uvicorn's worker processes) keep a step's arrays. Returns
    the tunables set here: none where the operator named them all or malloc is not glibc's."""
    ours = _ours_unset(environ)
    environ["GLIBC_TUNABLES"] = with_malloc_tunables(environ)
    try:
        mallopt = ctypes.CDLL(None).mallopt  # glibc (and musl's, which ignores it)
    except (AttributeError, OSError, TypeError):  # no mallopt (macOS); no CDLL(None) (Windows)
        return []
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return [t for t in ours if mallopt(_MALLOPT[t.split("=", 1)[0]], int(t.split("=", 1)[1])) == 1]
