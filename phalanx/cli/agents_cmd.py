"""`phalanx agents rollout | status | stop`: phones that upgrade their agent themselves."""

from __future__ import annotations

from typing import Annotated, Any, Optional

import typer

from phalanx.cli.user_cmds import Output, OutputOpt, ServerOpt, TokenOpt, connect, emit, out
from phalanx.demo.view import dash

agents_app = typer.Typer(help="Roll the server's agent build out to the phones (admin).",
                         no_args_is_help=True)


def rollout_table(status: dict[str, Any]) -> Any:
    from rich.table import Table

    table = Table(header_style="bold", title_justify="left", title=(
        f"rollout of agent {status['version']} ({dash(status.get('sha256'))[:12]}), "
        f"{status['max_parallel']} at a time" if status.get("active") else "no rollout"))
    for col in ("SERVED", "UP TO DATE", "UPGRADING", "FAILED", "WAITING", "CANNOT", "VERSIONS"):
        table.add_column(col, no_wrap=True)
    devices = status.get("devices") or {}
    versions = ", ".join(f"{v}: {n}" for v, n in sorted((status.get("versions") or {}).items()))
    table.add_row(status["served"]["version"], *(str(devices.get(k, 0)) for k in
                  ("up_to_date", "upgrading", "failed", "waiting", "cannot")), versions or "-")
    return table


@agents_app.command("rollout")
def agents_rollout(
    max_parallel: Annotated[int, typer.Option(min=1, help="phones upgrading at the same "
                                              "time")] = 1,
    version: Annotated[Optional[str], typer.Option(
        help="the version you expect the server to serve (refused if it serves another)")] = None,
    server: ServerOpt = None, token: TokenOpt = None, output: OutputOpt = Output.table,
) -> None:
    """Upgrade every phone to the agent this server serves, a few at a time, each between
    jobs; a phone whose new agent does not start rolls back and is not asked again."""
    with connect(server, token) as client:
        emit(client.start_rollout(max_parallel, version), output, rollout_table)


@agents_app.command("status")
def agents_status(server: ServerOpt = None, token: TokenOpt = None,
                  output: OutputOpt = Output.table) -> None:
    """The rollout in force and how far it is (per phone: `phalanx devices ls -o wide`)."""
    with connect(server, token) as client:
        emit(client.rollout(), output, rollout_table)


@agents_app.command("stop")
def agents_stop(server: ServerOpt = None, token: TokenOpt = None,
                output: OutputOpt = Output.table) -> None:
    """Stop the rollout: no phone starts an upgrade (those installing finish)."""
    with connect(server, token) as client:
        status = client.stop_rollout()
    out.print("rollout stopped")
    emit(status, output, rollout_table)


@agents_app.command("key")
def agents_key(server: ServerOpt = None, token: TokenOpt = None,
               output: OutputOpt = Output.table) -> None:
    """The key this server signs agent builds with. Phones installed with the install line
    carry it; pin it on others: `install.sh --release-key KEY` (or `phalanx-agent
    install-launcher --release-key KEY`). `phalanx-agent probe` on a phone lists the
    fingerprints it trusts."""
    with connect(server, token) as client:
        key = client.json("GET", "/v1/agent/release-key")
    if output is Output.table:
        # one line, never wrapped: it is pasted onto phones
        typer.echo(f"{key['algorithm']} {key['public_key']}  (fingerprint {key['fingerprint']})")
    else:
        emit(key, output, lambda k: k)


def register(app: typer.Typer) -> None:
    """Mount this module's commands on the root app."""
    app.add_typer(agents_app, name="agents")
