"""Rich renderings shared by the CLI and the demo: device and job tables, a job progress bar.

The API's objects are read tolerantly (a device's telemetry may be `telemetry` or
`latest_telemetry`, a job's devices a list of ids or of `{device_id, shards}`), so a field the
server adds or renames shows as "-" rather than crashing a table.
"""

from __future__ import annotations

import datetime as dt
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from wire.states import FINISHED_STATES, DeviceState, JobState

TERMINAL = FINISHED_STATES
# str keys: a state's value (an Enum member hashes by its name)
STATE_STYLE = {DeviceState.READY.value: "green", JobState.RUNNING.value: "cyan",
               JobState.SUCCEEDED.value: "green", DeviceState.NOT_READY.value: "red",
               JobState.FAILED.value: "red", JobState.CANCELLED.value: "yellow",
               DeviceState.CORDONED.value: "yellow", DeviceState.DRAINING.value: "yellow",
               JobState.PENDING.value: "blue"}


def dash(value: Any, fmt: str = "{}") -> str:
    return "-" if value is None or value == "" else fmt.format(value)


def styled(state: str | None) -> str:
    style = STATE_STYLE.get(state or "")
    return f"[{style}]{state}[/{style}]" if style and state else dash(state)


def telemetry(device: dict[str, Any]) -> dict[str, Any]:
    for key in ("telemetry", "latest_telemetry"):
        if isinstance(device.get(key), dict):
            return device[key]
    return {}


def ago(value: Any, now: dt.datetime | None = None) -> str:
    """`12s`, `3m`, `2h` since an ISO timestamp or Unix seconds; "-" when unknown."""
    try:
        if isinstance(value, (int, float)):
            then = dt.datetime.fromtimestamp(value, dt.timezone.utc)
        else:
            then = dt.datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except (TypeError, ValueError, OverflowError):
        return "-"
    if then.tzinfo is None:
        then = then.replace(tzinfo=dt.timezone.utc)
    secs = max(0.0, ((now or dt.datetime.now(dt.timezone.utc)) - then).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if secs >= size:
            return f"{int(secs // size)}{unit}"
    return f"{int(secs)}s"


def shards_by_device(job: dict[str, Any]) -> dict[str, int | None]:
    """How many shards each device of a job holds (None: holds some, the count not shown).

    Reads `shards` / `assignments` ({device: [k...] or count}) where the server gives them,
    else `devices` (the ids of the holders)."""
    raw = job.get("shards") or job.get("assignments") or job.get("devices") or []
    out: dict[str, int | None] = {}
    if isinstance(raw, dict):
        raw = [{"device_id": k, "shards": v} for k, v in raw.items()]
    for item in raw:
        if isinstance(item, str):
            out[item] = None
            continue
        if not isinstance(item, dict):
            continue
        dev = item.get("device_id") or item.get("id")
        shards = item.get("shards", item.get("n_shards", 0))
        count = len(shards) if isinstance(shards, list) else int(shards or 0)
        if dev:
            out[str(dev)] = (out.get(str(dev)) or 0) + count
    return out


def shard_cell(shards: dict[str, int | None] | None, device_id: Any) -> str:
    if shards is None or str(device_id) not in shards:
        return "-"
    count = shards[str(device_id)]
    return "✓" if count is None else str(count)


def agent_cell(dev: dict[str, Any]) -> str:
    """The agent's version, and the rollout's doing: `0.1.0 → 0.2.0` while it installs,
    `0.1.0 (0.2.0 failed)` once it could not."""
    cell = dash(dev.get("agent_version"))
    target = (dev.get("upgrade_to") or {}).get("version")
    if target:
        return f"{cell} → {target}"
    if dev.get("upgrade_failed"):
        return f"{cell} [red]({dev['upgrade_failed']} failed)[/red]"
    return cell


def device_table(devices: list[dict[str, Any]], shards: dict[str, int | None] | None = None,
                 notes: dict[str, str] | None = None, title: str | None = None,
                 show_id: bool = True, arch: str | None = None, wide: bool = False) -> Table:
    """One row per device; with `arch`, the speed the agent measured for that model; `wide`
    adds the labels, the agent's version and the compute class (what a `class` job's shards
    must share: machine, BLAS library and kernel, SIMD level, #fingerprint)."""
    table = Table(title=title, title_justify="left", header_style="bold")
    cols = ["ID", "NAME", "STATE", "MODEL", "BATTERY", "TEMP", "FREQ", "SHARDS", "SEEN"]
    if arch:
        cols.insert(-1, "SAMPLES/S")
    for col in cols if show_id else cols[1:]:
        table.add_column(col, no_wrap=True)
    if wide:
        for col in ("LABELS", "AGENT", "COMPUTE CLASS"):
            table.add_column(col, no_wrap=col == "COMPUTE CLASS")
    if notes is not None:
        table.add_column("NOTE")
    for dev in devices:
        t = telemetry(dev)
        spec = dev.get("spec") or {}
        battery = dash(t.get("battery_pct"), "{:.0f}%")
        if t.get("charging"):
            battery += " ⚡"
        temp = dash(t.get("cpu_temp_c", t.get("battery_temp_c")), "{:.1f}°C")
        if t.get("throttled"):
            temp += " [red]throttled[/red]"
        state = styled(dev.get("state"))
        if dev.get("pause_reason"):
            state += f" [yellow]({dev['pause_reason']})[/yellow]"
        seen = dev.get("last_heartbeat_at") or dev.get("lease_renewed_at") or t.get("ts")
        row = [dash(dev.get("name")), state, dash(spec.get("model")), battery,
               temp, dash(t.get("cpu_freq_mhz"), "{:.0f} MHz"),
               shard_cell(shards, dev.get("id")),
               ago(seen)]
        if arch:
            measured = (dev.get("profiles") or {}).get(arch) or {}
            row.insert(-1, dash(measured.get("samples_per_s"), "{:,.0f}"))
        if show_id:
            row.insert(0, dash(dev.get("id")))
        if wide:
            labels = dev.get("labels") or {}
            row += [",".join(f"{k}={v}" for k, v in sorted(labels.items())) or "-",
                    agent_cell(dev), dash(dev.get("compute_class"))]
        if notes is not None:
            row.append(notes.get(str(dev.get("id")), ""))
        table.add_row(*row)
    return table


def exactness_cell(job: dict[str, Any]) -> str:
    """`portable`, or `class #be23673d` (the job's compute class; `class` before it is placed)."""
    exactness = job.get("exactness") or (job.get("spec") or {}).get("exactness")
    fingerprint = job.get("compute_class")
    if exactness and isinstance(fingerprint, str):
        return f"{exactness} #{fingerprint[:8]}"
    return dash(exactness)


def metric(job: dict[str, Any], *names: str) -> float | None:
    metrics = job.get("metrics") or {}
    for name in names:
        if isinstance(metrics.get(name), (int, float)):
            return float(metrics[name])
    return None


def job_table(jobs: list[dict[str, Any]], wide: bool = False) -> Table:
    """One row per job; `wide` adds its priority, model, dataset, exactness and why it waits
    or ended."""
    table = Table(header_style="bold")
    cols = ["ID", "NAME", "OWNER", "STATE", "STEP", "LOSS", "VAL ACC", "DEVICES", "AGE"]
    for col in cols + (["PRIORITY", "MODEL", "DATASET", "EXACTNESS", "REASON"] if wide else []):
        table.add_column(col, no_wrap=col != "REASON")
    for job in jobs:
        row = [dash(job.get("id")), dash(job.get("name")), job.get("owner") or "(admin)",
               styled(job.get("state")), f"{job.get('step', 0)}/{job.get('total_steps', '?')}",
               dash(metric(job, "train_loss"), "{:.4f}"),
               dash(metric(job, "val_accuracy"), "{:.2%}"),
               str(len(shards_by_device(job))), ago(job.get("created"))]
        if wide:
            spec = job.get("spec") or {}
            row += [str(job.get("priority", 0)), dash((spec.get("model") or {}).get("arch")),
                    dash(spec.get("dataset")), exactness_cell(job), dash(job.get("reason"))]
        table.add_row(*row)
    return table


def si(value: float | None, unit: str = "") -> str:
    """1234567 -> '1.23 M' (decimal prefixes), None -> '-'."""
    if value is None:
        return "-"
    for factor, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(value) >= factor:
            return f"{value / factor:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}".rstrip()


def mib(value: float | None) -> str:
    return "-" if value is None else f"{value / 2**20:,.0f} MiB"


def plan_view(answer: dict[str, Any]) -> Table:
    """A dry run's answer: the plan's totals, the layers, and where the job could run."""
    plan, placement = answer.get("plan") or {}, answer.get("placement") or {}
    table = Table(show_header=False, box=None, title=f"plan of {answer.get('name', '?')}",
                  title_justify="left", title_style="bold")
    table.add_column(style="bold")
    table.add_column()
    rows = [("parameters", f"{plan.get('parameters', 0):,}"),
            ("FLOPs per sample (fwd+bwd)", si(plan.get("flops_per_sample"), "FLOP")),
            ("FLOPs per step", si(plan.get("flops_per_step"), "FLOP")),
            ("micro-batch per shard", dash(plan.get("micro_batch"))),
            ("memory per phone", mib(plan.get("memory_per_device_bytes"))),
            ("total steps", dash(answer.get("total_steps"))),
            ("bytes per step", f"{si(plan.get('bytes_per_step'), 'B')} "
                               f"({dash(plan.get('devices_counted'))} devices)"),
            ("exactness", dash(placement.get("exactness") or
                               (answer.get("spec") or {}).get("exactness"))),
            ("eligible devices now", dash(placement.get("eligible")))]
    if (plan.get("slices") or 1) > 1:  # the vector applied in slices (engine.slices)
        rows.insert(-1, ("slices", f"{plan['slices']} (the largest "
                                   f"{plan.get('largest_slice_parameters', 0):,} parameters)"))
    for reason, count in (placement.get("reasons") or {}).items():
        rows.append((f"  not: {reason}", str(count)))
    # a class job: the compute classes it could go on, the one it would take first
    for i, cls in enumerate(placement.get("compute_classes") or []):
        rows.append((f"  class {'(first choice)' if i == 0 else ''}".rstrip(),
                     f"{cls.get('label') or '#' + str(cls.get('fingerprint'))[:8]}: "
                     f"{cls.get('devices')} device(s), {si(cls.get('speed'))} samples/s"))
    if placement.get("exactness") == "class" and not placement.get("compute_classes"):
        rows.append(("  class", "none: no eligible device reports a compute class"))
    for row in rows:
        table.add_row(*row)
    return table


def layer_table(plan: dict[str, Any]) -> Table:
    table = Table(header_style="bold")
    for col in ("LAYER", "TYPE", "OUTPUT", "PARAMS", "FLOPS/SAMPLE"):
        table.add_column(col, no_wrap=True)
    for layer in plan.get("layers") or []:
        table.add_row(layer["path"], layer["type"], "x".join(map(str, layer["out_shape"])),
                      f"{layer['parameters']:,}", si(layer["flops_per_sample"]))
    return table


def event_table(events: list[dict[str, Any]]) -> Table:
    table = Table(header_style="bold")
    for col in ("AGE", "TYPE", "REASON", "DEVICE", "MESSAGE"):
        table.add_column(col)
    for ev in events:
        kind = ev.get("kind") or ev.get("type") or "Normal"
        table.add_row(ago(ev.get("ts")), f"[yellow]{kind}[/yellow]" if kind == "Warning" else kind,
                      dash(ev.get("reason")), dash(ev.get("device_id")), dash(ev.get("message")))
    return table


class JobProgress:
    """A progress bar over a job's steps with its state, loss and validation accuracy."""

    def __init__(self) -> None:
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TextColumn("{task.fields[state]}"), TextColumn("loss {task.fields[loss]}"),
            TextColumn("val acc {task.fields[acc]}"), TimeElapsedColumn(),
        )
        self._task: Any = None

    def update(self, job: dict[str, Any]) -> None:
        state = styled(job.get("state"))
        if job.get("state") == JobState.PENDING and job.get("reason"):
            state += f" [dim]({str(job['reason'])[:60]})[/dim]"
        fields = {"state": state,
                  "loss": dash(metric(job, "train_loss"), "{:.4f}"),
                  "acc": dash(metric(job, "val_accuracy"), "{:.2%}")}
        total = max(1, int(job.get("total_steps") or 1))
        if self._task is None:
            self._task = self.progress.add_task(str(job.get("name") or job.get("id")),
                                                total=total, **fields)
        self.progress.update(self._task, completed=int(job.get("step") or 0), total=total,
                             **fields)
