"""The step protocol (work, weights, shard data, gradient uploads): owned by the scheduler side.

`install(app, settings)` is called by `api.main.create_app`; it mounts the routes and wires the
hot-state store and the scheduler hooks (see docs/contracts.md).
"""

from __future__ import annotations

from typing import Any


def install(app: Any, settings: Any) -> None:
    """Mount the step-protocol routes on `app`."""
