"""The `phalanx` command line: one typer app; each area registers its own commands."""

from __future__ import annotations

from typing import Annotated

import typer

from phalanx import __version__
from phalanx.cli import (
    agents_cmd,
    demo_cmd,
    model_cmds,
    server_cmd,
    train_cmd,
    user_cmds,
    worker_cmd,
)

app = typer.Typer(
    name="phalanx",
    help="Phalanx: a cluster manager that turns racks of Android phones into a training cluster.",
    no_args_is_help=True,
)


def _print_version(asked: bool) -> None:
    if asked:
        typer.echo(__version__)
        raise typer.Exit()


@app.callback()
def main(version: Annotated[bool, typer.Option(
        "--version", callback=_print_version, is_eager=True,
        help="print the version and exit")] = False) -> None:
    """Phalanx: a cluster manager that turns racks of Android phones into a training cluster."""



@app.command()
def version() -> None:
    """Print the Phalanx version."""
    typer.echo(__version__)


for module in (server_cmd, worker_cmd, train_cmd, user_cmds, model_cmds, agents_cmd, demo_cmd):
    module.register(app)

if __name__ == "__main__":
    app()
