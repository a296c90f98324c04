"""`phalanx demo` (the README's first command) and `phalanx sim` (a fleet for scale tests)."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.console import Console

from wire.states import JobState

console = Console(width=None if sys.stdout.isatty() else 140)
err = Console(stderr=True)


def demo(
    phones: Annotated[int, typer.Option(min=1, max=64, help="simulated phones")] = 6,
    job: Annotated[Optional[Path], typer.Option(help="job spec (YAML/JSON) instead of digits-cnn")] = None,
    keep_running: Annotated[bool, typer.Option(help="leave the server and phones up afterwards")] = False,
    data_dir: Annotated[Optional[Path], typer.Option(help="where the server, phones and checkpoint live")] = None,
    faults: Annotated[bool, typer.Option(help="overheat one phone and kill another mid-run")] = True,
    liars: Annotated[int, typer.Option(min=0, help="phones that corrupt their results: audits "
                                       "catch and quarantine them")] = 0,
    lie: Annotated[str, typer.Option(help="how a liar lies: MODE[:EVERY[:FROM_STEP]], MODE flip "
                                     "(one float changed) or stale (the previous step's "
                                     "result)")] = "flip:1:0",
) -> None:
    """Run a real training job on an embedded control plane and a simulated fleet of phones."""
    from phalanx.cli.user_cmds import read_spec
    from phalanx.client import PhalanxError
    from phalanx.demo.run import DEFAULT_JOB, Demo, DemoOptions, DemoResult

    spec = read_spec(job) if job else dict(DEFAULT_JOB)
    opts = DemoOptions(phones=phones, job=spec, keep_running=keep_running, data_dir=data_dir,
                       faults=faults, liars=min(liars, phones), lie=_lie(lie))

    def wait_for_ctrl_c(result: DemoResult) -> None:
        console.print(f"\nserver: {result.server_url}\nadmin token: {result.admin_token}\n"
                      f"try:  PHALANX_SERVER={result.server_url} PHALANX_TOKEN={result.admin_token}"
                      f" phalanx devices ls\nin a browser: {result.server_url}/ui (log in with "
                      "the admin token)\nPress Ctrl-C to stop.", highlight=False, soft_wrap=True)
        try:
            while True:
                time.sleep(3600)
        except KeyboardInterrupt:
            console.print("stopping")

    stop_on_signals()
    try:
        result = Demo(opts, console).run(on_ready=wait_for_ctrl_c)
    except (PhalanxError, RuntimeError) as exc:
        err.print(f"[red]error:[/red] {exc}", highlight=False, soft_wrap=True)
        raise typer.Exit(1) from None
    if not result.succeeded:
        raise typer.Exit(1)


def stop_on_signals() -> None:
    """SIGTERM (`kill`) and SIGHUP (a closed terminal) stop the demo as Ctrl-C does: it stops
    the phones, their compute workers and the server before it exits. A second one while they
    stop is ignored (a second Ctrl-C is not: it leaves them behind)."""

    def interrupt(signum: int, frame: object) -> None:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN)
        raise KeyboardInterrupt

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, interrupt)


def sim(
    phones: Annotated[int, typer.Option(min=1, help="simulated phones")] = 1000,
    server: Annotated[Optional[str], typer.Option("--server", "-s", envvar="PHALANX_SERVER")] = None,
    token: Annotated[Optional[str], typer.Option("--token", envvar="PHALANX_TOKEN", help="admin token")] = None,
    enroll_token: Annotated[Optional[str], typer.Option(help="use this enrollment token")] = None,
    duration: Annotated[float, typer.Option(help="seconds to run after start")] = 60.0,
    interval: Annotated[Optional[float], typer.Option(help="heartbeat interval (default: the server's)")] = None,
    concurrency: Annotated[int, typer.Option(help="open HTTP connections")] = 64,
    compute: Annotated[bool, typer.Option(help="take and compute real work")] = False,
    job: Annotated[Optional[Path], typer.Option(help="submit this job spec; stop when it ends (implies --compute)")] = None,
    cleanup: Annotated[bool, typer.Option(help="delete the simulated devices at the end")] = True,
    label: Annotated[list[str], typer.Option("--label", "-l", help="k=v on every phone")] = [],  # noqa: B006
    output: Annotated[str, typer.Option("--output", "-o", help="table or json")] = "table",
    mode: Annotated[str, typer.Option(help="light (a PhoneModel and an httpx request per phone), "
                                      "swarm (100,000 phones on one core: phalanx.sim.swarm) or "
                                      "auto (swarm above 1,000 phones without --compute)")] = "auto",
    work_every: Annotated[float, typer.Option(help="swarm: seconds between a phone's work polls "
                                              "(wait=0); 0: none")] = 0.0,
    liars: Annotated[int, typer.Option(min=0, help="--compute: the first N phones corrupt "
                                       "their results (audits catch them)")] = 0,
    lie: Annotated[str, typer.Option(help="how a liar lies: MODE[:EVERY[:FROM_STEP]]")] = "flip:1:0",
) -> None:
    """Many lightweight simulated phones in one process against a real server."""
    from phalanx.cli.user_cmds import parse_labels, read_spec
    from phalanx.client import PhalanxError, resolve_target
    from phalanx.sim.fleet import FleetOptions, FleetStats, run_fleet
    from phalanx.sim.swarm import SwarmOptions, run_swarm, swarm_mode

    try:
        target = resolve_target(server, token)
    except PhalanxError as exc:
        err.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(2) from None
    opts = FleetOptions(server=target.server, phones=phones, duration_s=duration,
                        interval_s=interval, enroll_token=enroll_token,
                        admin_token=target.token, concurrency=concurrency,
                        compute=compute or job is not None, cleanup=cleanup,
                        labels=parse_labels(label), job=read_spec(job) if job else None,
                        stop=threading.Event(), liars=liars, lie=_lie(lie))
    # SIGTERM ends the run early as the duration would: the phones stop, the report is printed
    signal.signal(signal.SIGTERM, lambda *_: opts.stop.set())  # type: ignore[union-attr]
    last = [0.0]

    def progress(stats: FleetStats) -> None:
        if output == "table" and time.monotonic() - last[0] >= 5:
            last[0] = time.monotonic()
            rep = stats.report()
            err.print(f"{rep['elapsed_s']:6.0f}s  enrolled {rep['phones_enrolled']:5d}  "
                      f"requests {rep['requests']:7d}  {rep['requests_per_s']:7.1f}/s  "
                      f"errors {rep['errors']}", highlight=False)

    try:
        if swarm_mode(mode, opts):
            report = run_swarm(SwarmOptions.from_fleet(opts, work_every_s=work_every,
                                                       json_progress=output == "json"))
        else:
            report = run_fleet(opts, progress)
    except SystemExit as exc:
        err.print(f"[red]error:[/red] {exc}", highlight=False)
        raise typer.Exit(1) from None
    if output == "json":
        typer.echo(json.dumps(report, indent=2))
    else:
        print_report(report)
    if report["errors"] or (report.get("job") and report["job"].get("state") != JobState.SUCCEEDED):
        raise typer.Exit(1)


def _lie(text: str) -> str:
    """A liar's MODE[:EVERY[:FROM_STEP]], checked (exit 2 naming the problem)."""
    from phalanx.sim.liar import Lie

    try:
        return str(Lie.parse(text))
    except ValueError as exc:
        err.print(f"[red]error:[/red] --lie: {exc}", highlight=False)
        raise typer.Exit(2) from None


def print_report(report: dict) -> None:
    from rich.table import Table

    table = Table(title="phalanx sim", title_justify="left", header_style="bold")
    for col in ("ENDPOINT", "REQUESTS", "P50 MS", "P99 MS", "MAX MS"):
        table.add_column(col)
    for ep, row in report["endpoints"].items():
        lat = row["latency_ms"]
        table.add_row(ep, str(row["requests"]), str(lat.get("p50", "-")),
                      str(lat.get("p99", "-")), str(lat.get("max", "-")))
    console.print(table)
    console.print(f"phones enrolled: {report['phones_enrolled']}\n"
                  f"requests: {report['requests']} in {report['elapsed_s']} s = "
                  f"{report['requests_per_s']} requests/s\n"
                  f"errors: {report['errors']}  retries: {report['retries']}", highlight=False)
    for kind, n in sorted(report["errors_by_kind"].items()):
        console.print(f"  {n:6d}  {kind}", highlight=False)
    for liar in report.get("liars") or []:
        console.print(f"liar {liar['name']} ({liar['lie']}): {liar['lies']} of {liar['results']} "
                      "results corrupted; " + (f"quarantined: {liar['quarantined']}"
                                               if liar["quarantined"] else "not caught"),
                      highlight=False)
    job = report.get("job")
    if job:
        acc = (job.get("metrics") or {}).get("val_accuracy")
        console.print(f"job {job['id']}: {job.get('state')} at step {job.get('step')}/"
                      f"{job.get('total_steps')}" + (f", val accuracy {acc:.2%}" if acc else "")
                      + f"; {report.get('computed_shards', 0)} shard results uploaded",
                      highlight=False)


def register(app: typer.Typer) -> None:
    """Mount this module's commands on the root app."""
    app.command("demo")(demo)
    app.command("sim")(sim)
