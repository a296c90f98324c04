"""kubectl-like commands for people: `login`, `devices`, `tokens`, `jobs`, `datasets`.

Every command talks to a server over HTTP through `phalanx.client`. `--server` / `--token`
(or `PHALANX_SERVER` / `PHALANX_TOKEN`) override what `phalanx login` saved. Output is a table,
or JSON with `-o json`. A server error is one line on stderr and exit status 1.
"""

from __future__ import annotations

import datetime as dt
import enum
import inspect
import io
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, Optional

import typer
import yaml
from rich.console import Console
from rich.live import Live

from phalanx import report
from phalanx.client import (
    Contexts,
    NoServer,
    PhalanxClient,
    PhalanxError,
    Unreachable,
    install_line,
    resolve_target,
    save_config,
)
from phalanx.demo import view
from pictures.numbers import metric
from wire.states import JobState

# Piped (grep, a file, a script) a table keeps each row on one line, as kubectl's does; rich
# would otherwise wrap it to COLUMNS or 80 columns, cutting the values a script looks for.
PIPED_WIDTH = 1000
out = Console(width=None if sys.stdout.isatty() else PIPED_WIDTH)
err = Console(stderr=True)


class Output(str, enum.Enum):
    table = "table"
    wide = "wide"  # the table with more columns
    json = "json"
    yaml = "yaml"


# exit codes a script can tell apart (2 is a usage error, typer's own)
EXIT_ERROR = 1  # the server answered with a refusal or an error
EXIT_UNREACHABLE = 3  # no answer: the server is down, unreachable or too slow
EXIT_JOB_FAILED = 4  # the watched job ended Failed or Cancelled


ServerOpt = Annotated[Optional[str], typer.Option(
    "--server", "-s", envvar="PHALANX_SERVER", help="control plane URL (default: from login)")]
TokenOpt = Annotated[Optional[str], typer.Option(
    "--token", envvar="PHALANX_TOKEN", help="bearer token (default: from login)")]
OutputOpt = Annotated[Output, typer.Option("--output", "-o", help="table, wide, json or yaml")]
IdArg = Annotated[str, typer.Argument(help="the object's id")]


def fail(message: str, code: int = EXIT_ERROR) -> None:
    err.print(f"[red]error:[/red] {message}", highlight=False, soft_wrap=True)
    raise typer.Exit(code)


@contextmanager
def connect(server: str | None, token: str | None) -> Iterator[PhalanxClient]:
    """A client for the resolved target; a PhalanxError anywhere inside is one line and its
    exit code (no server configured: 2; no answer: 3; a refusal: 1)."""
    try:
        target = resolve_target(server, token)
        with PhalanxClient.from_target(target) as client:
            yield client
    except NoServer as exc:
        fail(str(exc), 2)
    except Unreachable as exc:
        fail(str(exc), EXIT_UNREACHABLE)
    except PhalanxError as exc:
        fail(str(exc))


def emit(data: Any, output: Output, table: Callable[..., Any]) -> None:
    """`data` as asked: JSON or YAML as the API gave it, or `table`."""
    if output is Output.json:
        typer.echo(json.dumps(data, indent=2, sort_keys=True, default=str))
    elif output is Output.yaml:
        typer.echo(yaml.safe_dump(json.loads(json.dumps(data, default=str)), sort_keys=False,
                                  allow_unicode=True), nl=False)
    else:
        out.print(tabled(data, output, table))


def tabled(data: Any, output: Output, table: Callable[..., Any]) -> Any:
    """The table of `data`; wide: with its extra columns, where the table has them."""
    if output is Output.wide and "wide" in inspect.signature(table).parameters:
        return table(data, wide=True)
    return table(data)


def describe(obj: dict[str, Any]) -> str:
    """kubectl-describe-like text: the object as block YAML."""
    return yaml.safe_dump(obj, sort_keys=False, default_flow_style=False, allow_unicode=True)


def describe_job(job: dict[str, Any]) -> str:
    """describe, the job's metrics rounded to what matters (a loss 0.026, an accuracy 98.61%);
    -o json and -o yaml keep every digit."""
    shown = {k: _rounded(k, v) for k, v in (job.get("metrics") or {}).items()}
    return describe({**job, "metrics": shown} if "metrics" in job else job)


def _rounded(name: str, value: Any) -> Any:
    shown = metric(name, value)
    if shown is value or shown.endswith("%"):
        return shown
    number = shown.replace(",", "")
    return float(number) if "." in number or "e" in number else int(number)


def parse_labels(pairs: list[str]) -> dict[str, str]:
    labels = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            fail(f"--label wants key=value, got {pair!r}")
        labels[key] = value
    return labels


# -- login ------------------------------------------------------------------------------------

def login(server: Annotated[str, typer.Option("--server", "-s", envvar="PHALANX_SERVER",
                                              prompt="Server URL")],
          token: Annotated[str, typer.Option("--token", envvar="PHALANX_TOKEN", prompt=True,
                                             hide_input=True)],
          verify: Annotated[bool, typer.Option(help="check the token with the server first")] = True,
          ca_file: Annotated[Optional[Path], typer.Option(
              "--ca-file", exists=True, dir_okay=False, envvar="PHALANX_CA_FILE",
              help="PEM CA of an https server with the lab's own certificate")] = None,
          context: Annotated[Optional[str], typer.Option(
              help="save as this context (default: the current one) and switch to it")] = None,
          ) -> None:
    """Save the server URL and token for later commands (a 0600 config file)."""
    ca = str(ca_file.resolve()) if ca_file else None
    if verify:
        try:
            with PhalanxClient(server, token, ca_file=ca) as client:
                client.jobs()
        except PhalanxError as exc:
            fail(str(exc))
    path = save_config(server.rstrip("/"), token, ca_file=ca, context=context)
    out.print(f"Logged in to {server.rstrip('/')}; saved to {path}", highlight=False)


config_app = typer.Typer(help="Contexts: the servers you have logged in to, as kubeconfig.",
                         no_args_is_help=True)


@config_app.command("get-contexts")
def config_get_contexts(output: OutputOpt = Output.table) -> None:
    """The saved contexts (never their tokens); * marks the current one."""
    try:
        saved = Contexts.load()
    except PhalanxError as exc:
        fail(str(exc))
    rows = [{"current": name == saved.current, "name": name, "server": ctx.get("server"),
             "ca_file": ctx.get("ca_file")} for name, ctx in sorted(saved.contexts.items())]

    def table(items: list[dict[str, Any]]) -> Any:
        from rich.table import Table

        t = Table(header_style="bold")
        for col in ("CURRENT", "NAME", "SERVER", "CA FILE"):
            t.add_column(col, no_wrap=True)
        for r in items:
            t.add_row("*" if r["current"] else "", r["name"], view.dash(r["server"]),
                      view.dash(r["ca_file"]))
        return t

    emit(rows, output, table)


@config_app.command("use-context")
def config_use_context(name: Annotated[str, typer.Argument(help="a saved context")]) -> None:
    """Make a saved context the current one."""
    try:
        saved = Contexts.load()
        if name not in saved.contexts:
            known = ", ".join(sorted(saved.contexts)) or "none: run phalanx login --context"
            fail(f"no context {name!r} (saved: {known})")
        saved.current = name
        saved.save()
    except PhalanxError as exc:
        fail(str(exc))
    out.print(f"Switched to context {name!r} ({saved.contexts[name].get('server')})",
              highlight=False)


# -- devices ----------------------------------------------------------------------------------

devices_app = typer.Typer(help="List, inspect and manage phones.", no_args_is_help=True)


SelectorOpt = Annotated[Optional[str], typer.Option(
    "--selector", "-l", help="labels, as kubectl: rack=a,zone!=b,gpu in (x,y),!spare")]


WatchOpt = Annotated[bool, typer.Option("--watch", "-w", help="redraw every --interval s "
                                        "until Ctrl-C")]
IntervalOpt = Annotated[float, typer.Option(min=0.2, help="seconds between redraws")]


def watched(fetch: Callable[[], Any], output: Output, table: Callable[..., Any],
            watch: bool, interval: float) -> None:
    """Print once, or with --watch redraw the table in place (JSON/YAML: one document per
    change) until interrupted."""
    if not watch:
        emit(fetch(), output, table)
        return
    last: Any = None
    try:
        if output in (Output.table, Output.wide):
            with Live(console=out, auto_refresh=False) as live:
                while True:
                    live.update(tabled(fetch(), output, table), refresh=True)
                    time.sleep(interval)
        while True:
            data = fetch()
            if data != last:
                emit(data, output, table)
                last = data
            time.sleep(interval)
    except KeyboardInterrupt:
        return


@devices_app.command("ls")
def devices_ls(selector: SelectorOpt = None,
               state: Annotated[Optional[str], typer.Option(
                   help="only these states, comma-separated (Ready,NotReady,...)")] = None,
               watch: WatchOpt = False, interval: IntervalOpt = 2.0,
               server: ServerOpt = None, token: TokenOpt = None,
               output: OutputOpt = Output.table) -> None:
    """List devices with their state and latest telemetry (filtered by the server)."""
    with connect(server, token) as client:
        watched(lambda: client.devices(selector=selector, state=state), output,
                view.device_table, watch, interval)


@devices_app.command("describe")
def devices_describe(device_id: IdArg, server: ServerOpt = None, token: TokenOpt = None,
                     output: OutputOpt = Output.table) -> None:
    """Everything the control plane knows about one device, then its last 10 events."""
    with connect(server, token) as client:
        device = client.device(device_id)
        events = client.device_events(device_id) if output is Output.table else []
    emit(device, output, describe)
    if events:
        out.print("Events:")
        out.print(view.event_table(events[-10:]))


@devices_app.command("logs")
def devices_logs(
    device_id: IdArg,
    follow: Annotated[bool, typer.Option("--follow", "-f",
                                         help="keep asking and print new lines as they come")] = False,
    timeout: Annotated[float, typer.Option(help="seconds to wait for the agent's answer")] = 60.0,
    interval: IntervalOpt = 5.0,
    server: ServerOpt = None, token: TokenOpt = None, output: OutputOpt = Output.table,
) -> None:
    """The agent's recent log lines (its last 500), fetched from the phone through the control
    plane: the agent ships them after its next heartbeat (admin)."""
    last = (float("-inf"), 0)  # (time, number) of the newest line printed
    with connect(server, token) as client:
        while True:
            got = client.device_logs(device_id, timeout_s=timeout)
            lines = got.get("lines") or []
            # by time first: an agent that restarted counts its lines from 1 again
            new = [line for line in lines if (line["ts"], line["seq"]) > last]
            if output is not Output.table:
                emit(new, output, describe)
            for line in new if output is Output.table else []:
                when = dt.datetime.fromtimestamp(line["ts"], dt.timezone.utc)
                out.print(f"{when:%Y-%m-%d %H:%M:%S} {line['level']:<7} {line['message']}",
                          highlight=False, markup=False, soft_wrap=True)
            last = max([last, *((line["ts"], line["seq"]) for line in new)])
            if not follow:
                return
            time.sleep(interval)


@devices_app.command("label")
def devices_label(
    device_id: IdArg,
    changes: Annotated[list[str], typer.Argument(help="k=v sets a label, k- removes it")],
    server: ServerOpt = None, token: TokenOpt = None, output: OutputOpt = Output.table,
) -> None:
    """Set and remove a device's labels, as kubectl label does (admin)."""
    patch: dict[str, str | None] = {}
    for change in changes:
        if change.endswith("-") and "=" not in change:
            patch[change[:-1]] = None
        else:
            patch.update(parse_labels([change]))
    with connect(server, token) as client:
        device = client.label_device(device_id, patch)
    if output is Output.table:
        labels = ",".join(f"{k}={v}" for k, v in sorted((device.get("labels") or {}).items()))
        out.print(f"{device_id} labeled: {labels or '(none)'}", highlight=False)
    else:
        emit(device, output, describe)


def _device_action(action: str, past: str) -> Callable[..., None]:
    def command(device_id: IdArg, server: ServerOpt = None, token: TokenOpt = None,
                output: OutputOpt = Output.table) -> None:
        with connect(server, token) as client:
            device = client.device_action(device_id, action)
        if output is Output.json:
            emit(device, output, describe)
        else:
            state = device.get("state", "") if isinstance(device, dict) else ""
            out.print(f"{device_id} {past}" + (f" (state {state})" if state else ""),
                      highlight=False)
    command.__doc__ = {"cordon": "Mark a device unschedulable; its current work continues.",
                       "uncordon": "Make a cordoned or drained device schedulable again.",
                       "drain": "Move a device's shards elsewhere and keep it unschedulable."}[action]
    return command


for _action, _past in (("cordon", "cordoned"), ("uncordon", "uncordoned"), ("drain", "draining")):
    devices_app.command(_action)(_device_action(_action, _past))


@devices_app.command("rm")
def devices_rm(device_id: IdArg, server: ServerOpt = None, token: TokenOpt = None) -> None:
    """Delete a device; its token stops working and its shards move."""
    with connect(server, token) as client:
        client.delete_device(device_id)
    out.print(f"{device_id} deleted", highlight=False)


# -- tokens -----------------------------------------------------------------------------------

tokens_app = typer.Typer(help="Create, list and revoke tokens (admin).", no_args_is_help=True)


def _token_table(items: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    table = Table(header_style="bold")
    for col in ("ID", "KIND", "NAME", "DEVICE", "USES", "EXPIRES", "STATE", "AGE"):
        table.add_column(col, no_wrap=True)
    for t in items:
        uses = (f"{t['uses']}/{t['max_uses'] or '∞'}" if "uses" in t else "-")
        table.add_row(view.dash(t.get("id")), t.get("kind", "enrollment"),
                      view.dash(t.get("name") or t.get("description")),
                      view.dash(t.get("device_id")), uses, view.dash(t.get("expires_at")),
                      "revoked" if t.get("revoked") else "active", view.ago(t.get("created")))
    return table


@tokens_app.command("ls")
def tokens_ls(
    enroll: Annotated[bool, typer.Option("--enroll", help="enrollment tokens instead")] = False,
    server: ServerOpt = None, token: TokenOpt = None, output: OutputOpt = Output.table,
) -> None:
    """List API tokens (admin, user, device) or, with --enroll, enrollment tokens. Secrets
    are never shown again."""
    with connect(server, token) as client:
        items = client.enrollment_tokens() if enroll else client.tokens()
    emit(items, output, _token_table)


@tokens_app.command("revoke")
def tokens_revoke(
    token_id: Annotated[str, typer.Argument(help="tok-... or enr-...")],
    server: ServerOpt = None, token: TokenOpt = None,
) -> None:
    """Revoke a token now: an API token stops working at once, an enrollment token enrolls
    no more phones."""
    with connect(server, token) as client:
        client.revoke_token(token_id, enrollment=token_id.startswith("enr-"))
    out.print(f"{token_id} revoked", highlight=False)


@tokens_app.command("create")
def tokens_create(
    enroll: Annotated[bool, typer.Option("--enroll", help="a phone enrollment token")] = False,
    user: Annotated[bool, typer.Option("--user", help="a user API token (the default)")] = False,
    name: Annotated[Optional[str], typer.Option(help="who or what the token is for")] = None,
    label: Annotated[list[str], typer.Option("--label", "-l",
                                             help="k=v for every phone enrolled with it")] = [],  # noqa: B006
    ttl: Annotated[Optional[float], typer.Option(help="lifetime in seconds")] = None,
    max_uses: Annotated[Optional[int], typer.Option(help="enrollment token uses")] = None,
    server: ServerOpt = None, token: TokenOpt = None, output: OutputOpt = Output.table,
) -> None:
    """Create a token; the secret is shown once."""
    if enroll and user:
        fail("--user and --enroll exclude each other")
    with connect(server, token) as client:
        if enroll:
            body: dict[str, Any] = {"labels": parse_labels(label)}
            if name:
                body["description"] = name
            if ttl is not None:
                body["expires_in_s"] = ttl
            if max_uses is not None:
                body["max_uses"] = max_uses
            created = client.create_enrollment_token(**body)
            pins = client.install_pins()
            ca_file = client.ca_file
        else:
            extra = {"expires_in_s": ttl} if ttl is not None else {}
            created = client.create_user_token(name or "phalanx-cli", **extra)
        server_url = client.server
    if output is Output.json:
        emit(created, output, describe)
        return
    out.print(created.get("token", ""), highlight=False, soft_wrap=True)
    if enroll:
        where = (f" (first copy {ca_file} to the phone as server.pem)" if ca_file else "")
        err.print(f"on the phone (Termux){where}:\n"
                  + install_line(server_url, str(created.get("token")), pins, ca_file),
                  highlight=False, soft_wrap=True)


# -- jobs -------------------------------------------------------------------------------------

jobs_app = typer.Typer(help="Submit, follow and manage training jobs.", no_args_is_help=True)


def read_spec(path: Path) -> dict[str, Any]:
    """A job spec from YAML or JSON (yaml.safe_load reads both)."""
    try:
        text = path.read_text()
    except OSError as exc:
        fail(f"cannot read {path}: {exc.strerror or exc}")
    try:
        spec = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        fail(f"{path}{where}: not valid YAML: {problem}")
    if not isinstance(spec, dict):
        fail(f"{path}: a job spec is a mapping (name, model, dataset, ...), got {type(spec).__name__}")
    return spec


@jobs_app.command("submit")
def jobs_submit(
    file: Annotated[Path, typer.Option("--file", "-f", help="job spec, YAML or JSON")],
    watch: Annotated[bool, typer.Option("--watch", "-w", help="follow it until it ends")] = False,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="print the plan (parameters, FLOPs, memory per phone, bytes per step, "
                          "eligible devices) and submit nothing")] = False,
    server: ServerOpt = None, token: TokenOpt = None, output: OutputOpt = Output.table,
) -> None:
    """Submit a job spec; the server validates it completely."""
    spec = read_spec(file)
    with connect(server, token) as client:
        job = client.submit_job(spec, dry_run=dry_run)
    if dry_run:
        emit(job, output, view.plan_view)
        if output is Output.wide:
            out.print(view.layer_table(job.get("plan") or {}))
        return
    if output is Output.json:
        emit(job, output, describe)
    else:
        out.print(f"{job.get('id')} submitted ({job.get('state', JobState.PENDING.value)})", highlight=False)
    if watch:
        jobs_watch(str(job["id"]), server=server, token=token)


@jobs_app.command("ls")
def jobs_ls(state: Annotated[Optional[str], typer.Option(
                help="only these states, comma-separated (Pending,Running,...)")] = None,
            watch: WatchOpt = False, interval: IntervalOpt = 2.0,
            server: ServerOpt = None, token: TokenOpt = None,
            output: OutputOpt = Output.table) -> None:
    """List jobs with their progress and metrics (a user sees their own)."""
    with connect(server, token) as client:
        watched(lambda: client.jobs(state=state), output, view.job_table, watch, interval)


@jobs_app.command("describe")
def jobs_describe(job_id: IdArg, server: ServerOpt = None, token: TokenOpt = None,
                  output: OutputOpt = Output.table) -> None:
    """One job: spec, state, metrics, devices, and its latest events."""
    with connect(server, token) as client:
        job = client.job(job_id)
        events = client.job_events(job_id) if output is Output.table else []
    emit(job, output, describe_job)
    if events:
        out.print("Events:")
        out.print(view.event_table(events[-10:]))


@jobs_app.command("report")
def jobs_report(job_id: IdArg,
                out_file: Annotated[Path, typer.Option(
                    "--output-file", "-O", help="where to write the page")] = Path("report.html"),
                server: ServerOpt = None, token: TokenOpt = None) -> None:
    """One self-contained HTML page of a job: loss, accuracy, step time, samples/s, energy,
    and a timeline of which phone held its shards, with its events (opens offline)."""
    with connect(server, token) as client:
        path = report.write(client, job_id, out_file)
    out.print(f"report written to {path}", highlight=False)


@jobs_app.command("events")
def jobs_events(job_id: IdArg,
                follow: Annotated[bool, typer.Option(
                    "--follow", "-f", help="print new events as they come, until the job ends")] = False,
                interval: IntervalOpt = 1.0,
                server: ServerOpt = None, token: TokenOpt = None,
                output: OutputOpt = Output.table) -> None:
    """What happened to a job: scheduling, shard moves, checkpoints, the end."""
    with connect(server, token) as client:
        events = client.job_events(job_id)
        emit(events, output, view.event_table)
        seen = {e.get("id") for e in events}
        try:
            while follow:
                ended = client.job(job_id).get("state") in view.TERMINAL
                new = [e for e in client.job_events(job_id) if e.get("id") not in seen]
                if new:
                    emit(new, output, view.event_table)
                    seen.update(e.get("id") for e in new)
                if ended:
                    break
                time.sleep(interval)
        except KeyboardInterrupt:
            pass


@jobs_app.command("cancel")
def jobs_cancel(job_id: IdArg, server: ServerOpt = None, token: TokenOpt = None) -> None:
    """Cancel a job; its devices are freed at the next step boundary."""
    with connect(server, token) as client:
        job = client.cancel_job(job_id)
    out.print(f"{job_id} {job.get('state', 'cancelled')}", highlight=False)


@jobs_app.command("checkpoint")
def jobs_checkpoint(
    job_id: IdArg,
    out_path: Annotated[Optional[Path], typer.Option("--out", "-O", help="file to write")] = None,
    server: ServerOpt = None, token: TokenOpt = None,
) -> None:
    """Download the latest weights as an .npz of named arrays."""
    import numpy as np

    with connect(server, token) as client:
        data = client.checkpoint(job_id)
    path = out_path or Path(f"{job_id}.npz")
    path.write_bytes(data)
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            names = list(npz.files)
    except (ValueError, OSError):
        fail(f"{path}: the server sent {len(data)} bytes that are not an .npz")
    out.print(f"{path} ({len(data)} bytes; arrays: {', '.join(names)})", highlight=False)


def watch_job(client: PhalanxClient, job_id: str, poll_s: float = 1.0) -> dict[str, Any]:
    """Redraw a progress bar until the job is Succeeded, Failed or Cancelled."""
    bar = view.JobProgress()
    job = client.job(job_id)
    with Live(bar.progress, console=out, refresh_per_second=4, transient=False):
        while True:
            bar.update(job)
            if job.get("state") in view.TERMINAL:
                return job
            time.sleep(poll_s)
            job = client.job(job_id)


@jobs_app.command("watch")
def jobs_watch(job_id: IdArg, server: ServerOpt = None, token: TokenOpt = None) -> None:
    """Live progress until the job ends; exit 0 when it Succeeded, 4 when it did not."""
    with connect(server, token) as client:
        job = watch_job(client, job_id)
    line = f"{job_id} {job.get('state')}"
    if job.get("reason"):
        line += f": {job['reason']}"
    acc = view.metric(job, "val_accuracy")
    if acc is not None:
        line += f" (val accuracy {acc:.2%})"
    out.print(line, highlight=False)
    if job.get("state") != JobState.SUCCEEDED:
        raise typer.Exit(EXIT_JOB_FAILED)


# -- datasets ---------------------------------------------------------------------------------

datasets_app = typer.Typer(help="Datasets jobs can train on.", no_args_is_help=True)


def _dataset_table(items: list[dict[str, Any]]) -> Any:
    from rich.table import Table

    table = Table(header_style="bold")
    for col in ("NAME", "SAMPLES", "INPUT", "CLASSES", "SIZE", "SHARED"):
        table.add_column(col)
    for ds in items:
        shape = ds.get("input_shape")
        table.add_row(view.dash(ds.get("name")),
                      view.dash(ds.get("n_samples", ds.get("n_train"))),
                      "x".join(str(d) for d in shape) if isinstance(shape, list) else "-",
                      view.dash(ds.get("num_classes")),
                      view.dash(ds.get("size_bytes"), "{} B"),
                      "yes" if ds.get("public", True) else "no")
    return table


def upload_with_progress(client: PhalanxClient, name: str, data: bytes | Path
                         ) -> dict[str, Any]:
    """A resumable upload (it survives a dropped connection) with a bar of the bytes sent."""
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TransferSpeedColumn,
    )

    with Progress(TextColumn("uploading {task.description}"), BarColumn(), DownloadColumn(),
                  TransferSpeedColumn(), console=out, transient=True) as bar:
        task = bar.add_task(name, total=len(data) if isinstance(data, bytes)
                            else data.stat().st_size)
        return client.upload_resumable(name, data,
                                       on_progress=lambda sent: bar.update(task, completed=sent))


@datasets_app.command("ls")
def datasets_ls(server: ServerOpt = None, token: TokenOpt = None,
                output: OutputOpt = Output.table) -> None:
    """List the datasets you may train on: digits, yours, and those an admin shared (an
    admin: every one). SHARED: every user sees it."""
    with connect(server, token) as client:
        items = client.datasets()
    emit(items, output, _dataset_table)


DatasetArg = Annotated[str, typer.Argument(help="the dataset's name")]


@datasets_app.command("rm")
def datasets_rm(name: DatasetArg, server: ServerOpt = None, token: TokenOpt = None) -> None:
    """Remove one of your datasets and its files (an admin: anyone's). Refused while a job
    that has not finished trains on it."""
    with connect(server, token) as client:
        client.delete_dataset(name)
    out.print(f"dataset {name} removed", highlight=False)


@datasets_app.command("share")
def datasets_share(
    name: DatasetArg,
    unshare: Annotated[bool, typer.Option("--unshare", help="stop sharing it: its owner's "
                                          "(and admins') only again")] = False,
    server: ServerOpt = None, token: TokenOpt = None,
) -> None:
    """Let every user see and train on a dataset (admin): an upload is its uploader's
    until an admin shares it."""
    with connect(server, token) as client:
        client.share_dataset(name, public=not unshare)
    out.print(f"dataset {name} {'no longer shared' if unshare else 'shared with every user'}",
              highlight=False)


@datasets_app.command("upload")
def datasets_upload(
    file: Annotated[Path, typer.Argument(help=".npz with arrays x and y")],
    name: Annotated[Optional[str], typer.Option(help="dataset name (default: file name)")] = None,
    server: ServerOpt = None, token: TokenOpt = None, output: OutputOpt = Output.table,
) -> None:
    """Upload an .npz (x: samples, y: integer labels)."""
    import numpy as np

    try:  # the archive's index only: the file is sent a chunk at a time
        with np.load(file, allow_pickle=False) as npz:
            missing = {"x", "y"} - set(npz.files)
    except (OSError, ValueError) as exc:
        fail(f"{file}: not a readable .npz ({exc})")
    if missing:
        fail(f"{file}: missing array(s) {', '.join(sorted(missing))}; need x and y")
    with connect(server, token) as client:
        created = upload_with_progress(client, name or file.stem, file)
    if output is Output.json:
        emit(created, output, describe)
    else:
        out.print(f"dataset {created.get('name', name or file.stem)} uploaded", highlight=False)


@datasets_app.command("import")
def datasets_import(
    folder: Annotated[Path, typer.Argument(help="one sub-folder of images per class")],
    name: Annotated[Optional[str], typer.Option(help="dataset name (default: folder name)")] = None,
    size: Annotated[Optional[int], typer.Option(
        min=1, max=4096, help="resize every image to SIZE x SIZE (else all must match)")] = None,
    grayscale: Annotated[bool, typer.Option(help="one channel instead of RGB")] = False,
    save: Annotated[Optional[Path], typer.Option(
        help="also write the .npz here (and upload it later with datasets upload)")] = None,
    server: ServerOpt = None, token: TokenOpt = None, output: OutputOpt = Output.table,
) -> None:
    """Import a folder of images (classes = sub-folders, in name order) as a dataset: uint8
    pixels with the per-channel mean and std the server normalizes them by."""
    from rich.progress import Progress

    from phalanx import images

    try:
        found, _ = images.scan(folder)
        with Progress(console=out, transient=True) as bar:
            task = bar.add_task("decoding images", total=len(found))
            imported = images.load(folder, size, grayscale, lambda: bar.advance(task))
    except images.FolderError as exc:
        fail(str(exc))
    data = imported.npz()
    if save is not None:
        save.write_bytes(data)
    out.print(f"{len(imported.y)} images of {len(imported.classes)} classes "
              f"({', '.join(imported.classes[:8])}{', ...' if len(imported.classes) > 8 else ''}), "
              f"{'x'.join(map(str, imported.x.shape[1:]))}, {len(data):,} bytes", highlight=False)
    with connect(server, token) as client:
        created = upload_with_progress(client, name or folder.resolve().name, data)
    if output is Output.json:
        emit(created, output, describe)
    else:
        out.print(f"dataset {created.get('name')} uploaded", highlight=False)


def register(app: typer.Typer) -> None:
    """Mount this module's commands on the root app."""
    app.command("login")(login)
    app.add_typer(devices_app, name="devices")
    app.add_typer(tokens_app, name="tokens")
    app.add_typer(jobs_app, name="jobs")
    app.add_typer(datasets_app, name="datasets")
    app.add_typer(config_app, name="config")

