"""Optional dependencies that the test install always has: their absence fails the test, with
how to get them, instead of skipping it (a skipped equivalence test proves nothing)."""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest

HOW = "the test command installs it: pip install -e '.[dev,torch]' (as ./scripts/test does)"


def require(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        pytest.fail(f"{name} is needed by this test and missing ({exc}); {HOW}")
