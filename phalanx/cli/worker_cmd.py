"""Commands of this area (see docs/contracts.md for who owns what)."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Mount this module's commands on the root app."""
