"""A device's compute class as its agent reports it (`capabilities.compute_class`, the facts of
`engine.compute_class.describe()`): the fingerprint placement keeps a `class` job on, and the
short label people read (`phalanx devices ls -o wide`, `/ui`)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# engine.compute_class.fingerprint(): the first 16 hex digits of a SHA-256
FINGERPRINT_PATTERN = r"^[0-9a-f]{16}$"
_FINGERPRINT = re.compile(FINGERPRINT_PATTERN)


def valid_fingerprint(value: Any) -> str | None:
    return value if isinstance(value, str) and _FINGERPRINT.fullmatch(value) else None


def fingerprint_of(capabilities: Mapping[str, Any] | None) -> str | None:
    """The fingerprint a device's stored capabilities report; None when absent (an older
    agent) or not a well-formed one."""
    facts = (capabilities or {}).get("compute_class")
    return valid_fingerprint(facts.get("fingerprint")) if isinstance(facts, Mapping) else None


def label(facts: Mapping[str, Any] | None) -> str | None:
    """`x86_64 openblas SkylakeX X86_V4 #be23673d`: the machine, the BLAS library and kernel,
    numpy's SIMD level and the fingerprint's first 8 digits; None without a fingerprint."""
    if not isinstance(facts, Mapping):
        return None
    fingerprint = valid_fingerprint(facts.get("fingerprint"))
    if fingerprint is None:
        return None
    blas = facts.get("blas") if isinstance(facts.get("blas"), Mapping) else {}
    parts = [facts.get("machine"), blas.get("library"), blas.get("kernel"), facts.get("simd")]
    return " ".join([*(str(p) for p in parts if isinstance(p, str) and p), f"#{fingerprint[:8]}"])
