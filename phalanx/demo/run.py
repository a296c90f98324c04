"""`phalanx demo`: the embedded control plane, N simulated phones running the real agent, the
digits CNN job of DESIGN.md, live progress, a phone that overheats and one that dies mid-run.

The demo only uses public surfaces: `phalanx server` (a child process), `phalanx-agent
enroll/run` (one child process per phone, `phalanx.sim.phone`), and the HTTP API through
`phalanx.client` — what it shows is what any user of the cluster would see.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from phalanx import report
from phalanx.client import PhalanxClient, PhalanxError
from phalanx.demo import view
from phalanx.demo.faults import FaultPlan
from phalanx.demo.server import EmbeddedServer, start_embedded_server
from phalanx.sim.phone import PhoneOptions, PhoneRack, SimulatedPhone
from phalanx.sim.profiles import fleet_mix
from wire.states import DeviceState, JobState

# the phones heartbeat every 2 s in the demo (demo.server.DEMO_SETTINGS): two beats and a margin
ENERGY_WAIT_S = 5.0

DEFAULT_JOB: dict[str, Any] = {
    "name": "digits-cnn",
    "model": {"arch": "cnn"},
    "dataset": "digits",
    "global_batch_size": 256,
    "shards": 16,
    "epochs": 20,
    "seed": 0,
    "eval_every": 10,  # the report's validation curve: a point every 10 steps
    "optimizer": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.0001,
                  "warmup_epochs": 2, "schedule": "cosine"},
    "placement": {"min_devices": 1, "max_devices": 8, "selector": {"rack": "a"},
                  "min_battery": 20, "max_temp_c": 45},
}


@dataclass
class DemoOptions:
    phones: int = 6
    job: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_JOB))
    keep_running: bool = False
    data_dir: Path | None = None
    time_scale: float = 10.0  # phones heat and drain this much faster than in life
    faults: bool = True
    heat_at: float = 0.2  # fraction of the job's steps
    kill_at: float = 0.45
    offline_at: float = 0.65  # with 5 phones or more
    timeout_s: float = 900.0
    pending_s: float = 120.0  # give up when the job cannot be placed for this long
    refresh_s: float = 1.0
    liars: int = 0  # the last N phones corrupt their results (phalanx.sim.liar): caught by audits
    lie: str = "flip:1:0"


@dataclass
class DemoResult:
    job: dict[str, Any]
    wall_s: float
    job_s: float
    energy_j: float
    checkpoint: Path | None
    server_url: str
    admin_token: str
    faults: list[str] = field(default_factory=list)
    report: Path | None = None  # the job's page (phalanx.report)
    battery_energy_j: float = 0.0  # drawn by the phones on their batteries (the report's energy)

    @property
    def succeeded(self) -> bool:
        return self.job.get("state") == JobState.SUCCEEDED


def default_data_dir() -> Path:
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return Path.home() / ".local" / "share" / "phalanx" / f"demo-{stamp}"


class Demo:
    def __init__(self, opts: DemoOptions, console: Console | None = None) -> None:
        self.opts = opts
        self.console = console or Console()
        self.data_dir = opts.data_dir or default_data_dir()
        self.server: EmbeddedServer | None = None
        self.rack: PhoneRack | None = None
        self.client: PhalanxClient | None = None
        self.plan = FaultPlan(heat_at=opts.heat_at, kill_at=opts.kill_at,
                              offline_at=opts.offline_at)
        self.caught: dict[Any, str] = {}  # ResultMismatch event id -> the phone caught

    # -- setting up --------------------------------------------------------------------------
    def say(self, message: str) -> None:
        """A line of the demo's story; none when the terminal is gone (SIGHUP): the demo goes
        on to stop what it started."""
        with contextlib.suppress(OSError):
            self.console.print(f"[dim]{time.strftime('%H:%M:%S')}[/dim] {message}",
                               highlight=False, soft_wrap=True)

    def start_server(self) -> PhalanxClient:
        self.say(f"starting the control plane (embedded: SQLite, in-process Celery) in {self.data_dir}")
        self.server = start_embedded_server(self.data_dir / "server")
        self.client = PhalanxClient(self.server.url, self.server.admin_token)
        self.say(f"control plane up at {self.server.url}")
        return self.client

    def build_phones(self, token: str) -> list[SimulatedPhone]:
        assert self.server is not None
        phones = []
        for i, profile in enumerate(fleet_mix(self.opts.phones)):
            # every other phone on its battery: the report's energy is what the server can
            # measure, the batteries' draw (a charging phone's draw comes from its charger)
            liar = i >= self.opts.phones - self.opts.liars
            opts = PhoneOptions(battery_pct=90.0 - 7 * i, plugged=i % 2 == 0,
                                rooted=i % 3 != 2, time_scale=self.opts.time_scale,
                                labels={"rack": "a", "slot": str(i + 1)}, seed=i,
                                lie=self.opts.lie if liar else None)
            phones.append(SimulatedPhone(f"phone-{i + 1}", profile,
                                         self.data_dir / "phones" / f"phone-{i + 1}", opts))
        self.say(f"enrolling {len(phones)} phones with the real agent (phalanx-agent enroll)")
        with ThreadPoolExecutor(max_workers=min(4, len(phones))) as pool:
            list(pool.map(lambda p: p.enroll(self.server.url, token), phones))  # type: ignore[union-attr]
        return phones

    def wait_ready(self, client: PhalanxClient, n: int, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            ready = [d for d in client.devices() if d.get("state") == DeviceState.READY]
            if len(ready) >= n:
                self.say(f"{len(ready)} phones Ready")
                return
            time.sleep(0.5)
        raise PhalanxError(f"only some of the {n} phones became Ready within {timeout_s:.0f}s")

    # -- the scenario ----------------------------------------------------------------------------
    def inject_faults(self, job: dict[str, Any]) -> None:
        if self.opts.faults and self.rack is not None:
            self.plan.apply(self.rack.phones, job, self.say)

    # -- the live view ---------------------------------------------------------------------
    def frame(self, job: dict[str, Any], devices: list[dict[str, Any]],
              events: list[dict[str, Any]], bar: view.JobProgress) -> Group:
        table = view.device_table(devices, view.shards_by_device(job), self.plan.notes,
                                  title="Fleet (what the control plane sees)", show_id=False,
                                  arch=((job.get("spec") or {}).get("model") or {}).get("arch"))
        recent = Table.grid(padding=(0, 1))
        for ev in events[-5:]:
            recent.add_row(f"[dim]{view.ago(ev.get('ts'))}[/dim]", str(ev.get("reason", "")),
                           self.named(str(ev.get("message", "")))[:110])
        bar.update(job)
        return Group(table, bar.progress, recent)

    def named(self, text: str) -> str:
        """Device ids in a message replaced by the phones' names."""
        for phone in self.rack.phones if self.rack else []:
            if phone.device_id:
                text = text.replace(phone.device_id, phone.name)
        return text

    def follow(self, client: PhalanxClient, job_id: str) -> dict[str, Any]:
        bar = view.JobProgress()
        deadline = time.monotonic() + self.opts.timeout_s
        job = client.job(job_id)
        events: list[dict[str, Any]] = []
        pending_since: float | None = None
        with Live(console=self.console, refresh_per_second=4, transient=False) as live:
            while job.get("state") not in view.TERMINAL:
                if time.monotonic() > deadline:
                    raise PhalanxError(f"{job_id} did not finish within {self.opts.timeout_s:.0f}s")
                pending_since = (pending_since or time.monotonic()) if job.get("state") == JobState.PENDING else None
                if pending_since and time.monotonic() - pending_since > self.opts.pending_s:
                    raise PhalanxError(f"{job_id} still Pending after {self.opts.pending_s:.0f}s: "
                                       f"{job.get('reason') or 'no reason given'}")
                self.inject_faults(job)
                live.update(self.frame(job, client.devices(), events, bar))
                time.sleep(self.opts.refresh_s)
                job = client.job(job_id)
                events = client.job_events(job_id)
                self.tell_caught(events)
            live.update(self.frame(job, client.devices(), events, bar))
        return job

    def tell_caught(self, events: list[dict[str, Any]]) -> None:
        """A line for each phone an audit caught lying (its ResultMismatch event), once."""
        for ev in events:
            if ev.get("reason") == "ResultMismatch" and ev.get("id") not in self.caught:
                self.caught[ev.get("id")] = self.named(str(ev.get("device_id") or "?"))
                data = ev.get("data") or {}
                lo, hi = (data.get("node") or [0, 0])[:2]
                self.say(f"[red]caught a liar:[/red] {self.caught[ev.get('id')]} at step "
                         f"{data.get('step')}, shards {lo}..{hi - 1}: its result differs "
                         f"from two other phones'; quarantined (phalanx devices uncordon "
                         f"lifts it)")

    # -- the whole run ---------------------------------------------------------------------------
    def run(self, on_ready: Callable[[DemoResult], None] | None = None) -> DemoResult:
        started = time.monotonic()
        try:
            client = self.start_server()
            token = client.create_enrollment_token(labels={"rack": "a"},
                                                   description="phalanx demo")["token"]
            phones = self.build_phones(token)
            self.rack = PhoneRack(phones)
            self.rack.start()
            self.wait_ready(client, len(phones))
            energy0 = self.rack.energy_j()
            battery0 = self.rack.energy_j(on_battery=True)
            job = client.submit_job(self.opts.job)
            self.say(f"submitted {job['id']} ({job.get('name')}): "
                     f"{job.get('total_steps', '?')} steps")
            job_started = time.monotonic()
            job = self.follow(client, str(job["id"]))
            job_s = time.monotonic() - job_started
            result = DemoResult(job=job, wall_s=time.monotonic() - started, job_s=job_s,
                                energy_j=self.rack.energy_j() - energy0,
                                battery_energy_j=self.rack.energy_j(on_battery=True) - battery0,
                                checkpoint=self.save_checkpoint(client, job),
                                report=self.save_report(client, job),
                                server_url=self.server.url if self.server else "",
                                admin_token=self.server.admin_token if self.server else "",
                                faults=list(self.plan.log))
            self.summary(result)
            if self.opts.keep_running and on_ready is not None:
                on_ready(result)
            return result
        finally:
            self.close()

    def save_checkpoint(self, client: PhalanxClient, job: dict[str, Any]) -> Path | None:
        if job.get("state") != JobState.SUCCEEDED:
            return None
        path = self.data_dir / "checkpoints" / f"{job['id']}.npz"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(client.checkpoint(str(job["id"])))
        return path

    def save_report(self, client: PhalanxClient, job: dict[str, Any]) -> Path:
        names = {str(p.device_id): p.name for p in (self.rack.phones if self.rack else [])
                 if p.device_id}
        self.wait_for_last_step_energy(client, job)
        return report.write(client, str(job["id"]),
                            self.data_dir / "reports" / f"{job['id']}.html", names)

    def wait_for_last_step_energy(self, client: PhalanxClient, job: dict[str, Any]) -> None:
        """The report's energy chart reaches the last step once the phones have reported past
        it: their next heartbeat, a couple of seconds (a dead phone is not waited for)."""
        last = int(job.get("step") or 0) - 1
        deadline = time.monotonic() + ENERGY_WAIT_S
        while last >= 0 and time.monotonic() < deadline:
            page = client.json("GET", f"/v1/jobs/{job['id']}/metrics",
                               params={"since_step": last, "limit": 1})
            items = page.get("items") if isinstance(page, dict) else None
            if not items or items[0].get("energy_j") is not None:
                return
            time.sleep(0.25)

    def summary(self, r: DemoResult) -> None:
        acc = view.metric(r.job, "val_accuracy")
        lines = [
            f"job {r.job.get('id')} {r.job.get('state')}"
            + (f": {r.job['reason']}" if r.job.get("reason") else ""),
            f"final validation accuracy: {acc:.2%}" if acc is not None else
            "final validation accuracy: (not reported)",
            f"wall time: {r.wall_s:.1f} s in all, {r.job_s:.1f} s of training",
            f"energy estimate: {r.energy_j:.0f} J ({r.energy_j / 3600:.3f} Wh) for "
            f"{len(self.rack.phones) if self.rack else 0} phones during the job (modelled), "
            f"{r.battery_energy_j:.0f} J of it by those on their batteries (the report's energy, "
            "measured from their telemetry)",
            f"checkpoint: {r.checkpoint}" if r.checkpoint else "checkpoint: (none)",
            *([f"liars caught by audits: {', '.join(sorted(set(self.caught.values())))}"]
              if self.opts.liars else []),
            f"report (open it in a browser): {r.report}",
        ]
        for line in lines:  # never wrapped: a path cut in two cannot be pasted
            self.console.print(line, highlight=False, soft_wrap=True)

    def close(self) -> None:
        """Everything asked to stop at once, then waited for (the server drains long polls)."""
        if self.server is not None and self.server.alive:
            self.say("stopping the phones and the control plane")
            self.server.terminate()
        if self.rack is not None:
            self.rack.stop()
        if self.client is not None:
            self.client.close()
        if self.server is not None:
            self.server.stop()
