"""The `phalanx` command line: one typer app; each area registers its own commands."""

from __future__ import annotations

import typer

from phalanx.cli import demo_cmd, server_cmd, train_cmd, user_cmds, worker_cmd

app = typer.Typer(
    name="phalanx",
    help="Phalanx: a cluster manager that turns racks of Android phones into a training cluster.",
    no_args_is_help=True,
    add_completion=False,
)



@app.command()
def version() -> None:
    """Print the Phalanx version."""
    from phalanx import __version__

    typer.echo(__version__)


for module in (server_cmd, worker_cmd, train_cmd, user_cmds, demo_cmd):
    module.register(app)

if __name__ == "__main__":
    app()
