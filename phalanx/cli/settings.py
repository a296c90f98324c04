"""The control plane's settings for a command: one line per problem and exit 2 on a bad value,
not a traceback (the operator reads it in a container log)."""

from __future__ import annotations

import typer
from pydantic import ValidationError

from domain.settings import Settings


def load_settings() -> Settings:
    try:
        return Settings()
    except ValidationError as exc:
        for error in exc.errors(include_url=False):
            where = "".join(f"PHALANX_{'_'.join(str(p) for p in error['loc']).upper()}: "
                            for _ in error["loc"][:1])  # a rule over several fields: none
            typer.echo(f"phalanx: {where}{error['msg'].removeprefix('Value error, ')}", err=True)
        raise typer.Exit(2) from None
