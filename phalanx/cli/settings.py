"""The control plane's settings for a command: one line per problem and exit 2 on a bad value,
not a traceback (the operator reads it in a container log)."""

from __future__ import annotations

import typer
from pydantic import ValidationError

from api.settings import Settings


def load_settings() -> Settings:
    try:
        return Settings()
    except ValidationError as exc:
        for error in exc.errors(include_url=False):
            field = "PHALANX_" + "_".join(str(p) for p in error["loc"]).upper()
            typer.echo(f"phalanx: {field}: {error['msg'].removeprefix('Value error, ')}",
                       err=True)
        raise typer.Exit(2) from None
