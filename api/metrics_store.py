"""Fleet and job gauges, read from the store at scrape time.

Fleet state lives in the database, not in any one process, so these gauges are computed when
Prometheus scrapes: every API replica answers with the same values, and dashboards aggregate them
with `max` across instances (request counters, which are per process, use `sum`). No device id is
ever a label here: per-device drill-down goes to Postgres through Grafana's SQL datasource.
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, or_, select
from sqlalchemy.orm import Session, sessionmaker

from domain.store.energy import job_energy
from domain.store.models import Device, Event, Job, ShardAssignment, StepMetric
from wire.states import ACTIVE_STATES, DEVICE_STATES, JOB_STATES, DeviceState

PAUSE_REASONS = ("thermal", "battery", "busy")
# finished jobs keep their gauges this long, so the Job dashboard still shows how they ended
FINISHED_JOB_WINDOW = dt.timedelta(hours=6)
MAX_JOBS = 50
RATE_WINDOW_STEPS = 20  # samples/s over the last steps


@dataclass(frozen=True)
class FleetHistogram:
    metric: str
    help: str
    key: str
    bounds: tuple[float, ...]


FLEET_HISTOGRAMS = (
    FleetHistogram("phalanx_fleet_cpu_temperature_celsius",
                   "CPU temperature of Ready/Cordoned/Draining devices (latest sample)",
                   "cpu_temp_c", (25, 30, 35, 40, 45, 50, 55, 60, 70, 80)),
    FleetHistogram("phalanx_fleet_battery_temperature_celsius",
                   "Battery temperature of live devices (latest sample)",
                   "battery_temp_c", (20, 25, 30, 35, 38, 40, 42, 45, 50, 60)),
    FleetHistogram("phalanx_fleet_battery_percent", "Battery charge of live devices (latest sample)",
                   "battery_pct", (5, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100)),
    FleetHistogram("phalanx_fleet_power_watts", "Power draw of live devices (latest sample)",
                   "power_w", (0.5, 1, 1.5, 2, 3, 4, 5, 6, 8, 10, 15)),
)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def histogram(name: str, help_text: str, bounds: Sequence[float],
              values: Sequence[float]) -> HistogramMetricFamily:
    """A snapshot histogram (this scrape's fleet, not cumulative): read buckets, never rate()."""
    buckets = [(repr(float(b)), float(sum(1 for v in values if v <= b))) for b in bounds]
    buckets.append(("+Inf", float(len(values))))
    family = HistogramMetricFamily(name, help_text)
    family.add_metric([], buckets, float(sum(values)))
    return family


def fleet_metrics(session: Session) -> Iterable[Any]:
    rows = session.execute(select(Device.state, Device.pause_reason, Device.latest_telemetry,
                                  Device.name)).all()
    by_state = dict.fromkeys(DEVICE_STATES, 0)
    paused = dict.fromkeys(PAUSE_REASONS, 0)
    throttled = busy = 0
    readings: dict[str, list[float]] = defaultdict(list)
    named: dict[str, tuple[float, str]] = {}  # sensor key -> (hottest reading, its phone)
    for state, pause_reason, telemetry, name in rows:
        by_state[state] = by_state.get(state, 0) + 1
        if state == DeviceState.NOT_READY:
            continue  # a silent phone's last reading is not the fleet's present
        if pause_reason:
            paused[pause_reason] = paused.get(pause_reason, 0) + 1
        telemetry = telemetry or {}
        throttled += telemetry.get("throttled") is True
        busy += telemetry.get("busy") is True
        for hist in FLEET_HISTOGRAMS:
            value = _number(telemetry.get(hist.key))
            if value is not None:
                readings[hist.key].append(value)
        for key in ("cpu_temp_c", "battery_temp_c"):
            value = _number(telemetry.get(key))
            if value is not None and value > named.get(key, (float("-inf"), ""))[0]:
                named[key] = (value, name)
    yield _gauge("phalanx_devices", "Enrolled devices by state", "state", by_state)
    yield _gauge("phalanx_devices_paused", "Live devices paused by the agent (phone first), by "
                 "reason", "reason", paused)
    yield _scalar("phalanx_devices_registered", "Enrolled devices", len(rows))
    yield _scalar("phalanx_devices_throttled", "Live devices reporting CPU throttling", throttled)
    yield _scalar("phalanx_devices_busy", "Live devices in use by a person", busy)
    yield _scalar("phalanx_fleet_power_total_watts", "Sum of live devices' latest power draw",
                  sum(readings["power_w"]))
    hottest = GaugeMetricFamily("phalanx_fleet_max_temperature_celsius",
                                "Hottest live device's latest reading, by sensor",
                                labels=["sensor"])
    for sensor, key in (("cpu", "cpu_temp_c"), ("battery", "battery_temp_c")):
        hottest.add_metric([sensor], max(readings[key], default=0.0))
    yield hottest
    # one series per sensor whose label names the phone (bounded: never a series per device),
    # so an alert can say which phone to go and look at
    hottest_named = GaugeMetricFamily("phalanx_hottest_device_temperature_celsius",
                                      "The hottest live device's latest reading, by sensor, "
                                      "labelled with its name", labels=["sensor", "device"])
    for sensor, key in (("cpu", "cpu_temp_c"), ("battery", "battery_temp_c")):
        if key in named:
            hottest_named.add_metric([sensor, named[key][1]], named[key][0])
    yield hottest_named
    for hist in FLEET_HISTOGRAMS:
        yield histogram(hist.metric, hist.help, hist.bounds, readings[hist.key])
    enrolled = session.scalar(select(func.count()).select_from(Event)
                              .where(Event.reason == "Registered")) or 0
    yield CounterMetricFamily("phalanx_device_enrollments", "Devices enrolled (Registered events)",
                              value=float(enrolled))


def _gauge(name: str, help_text: str, label: str, values: dict[str, int]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, help_text, labels=[label])
    for key, value in sorted(values.items()):
        family.add_metric([key], float(value))
    return family


def _scalar(name: str, help_text: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, help_text, value=float(value))


def _recent_jobs(session: Session, now: dt.datetime) -> list[Job]:
    live = Job.state.in_(ACTIVE_STATES)
    recent = Job.finished_at >= now - FINISHED_JOB_WINDOW
    query = select(Job).where(or_(live, recent)).order_by(Job.created.desc()).limit(MAX_JOBS)
    return list(session.scalars(query))


def _job_devices(session: Session, job_ids: list[str]) -> dict[str, list[str]]:
    rows = session.execute(select(ShardAssignment.job_id, ShardAssignment.device_id)
                           .where(ShardAssignment.job_id.in_(job_ids)).distinct()).all()
    held: dict[str, list[str]] = defaultdict(list)
    for job_id, device_id in rows:
        held[job_id].append(device_id)
    return held


@dataclass
class StepRates:
    samples_per_s: float | None = None
    step_seconds: float | None = None
    val_accuracy: float | None = None


def _step_rates(session: Session, job_id: str) -> StepRates:
    rows = session.execute(
        select(StepMetric.samples, StepMetric.step_seconds, StepMetric.val_accuracy)
        .where(StepMetric.job_id == job_id).order_by(StepMetric.step.desc())
        .limit(RATE_WINDOW_STEPS)).all()
    timed = [(s, t) for s, t, _ in rows if t is not None and t > 0]
    rates = StepRates()
    if timed:
        rates.samples_per_s = sum(s for s, _ in timed) / sum(t for _, t in timed)
        rates.step_seconds = timed[0][1]
    rates.val_accuracy = next((v for _, _, v in rows if v is not None), None)
    return rates


JOB_GAUGES = (
    ("phalanx_job_step", "Steps applied"),
    ("phalanx_job_total_steps", "Steps the job will run"),
    ("phalanx_job_progress_ratio", "Steps applied / total steps"),
    ("phalanx_job_train_loss", "Latest training loss"),
    ("phalanx_job_train_accuracy", "Latest training accuracy"),
    ("phalanx_job_val_accuracy", "Latest validation accuracy"),
    ("phalanx_job_samples_per_second", "Training throughput over the last steps"),
    ("phalanx_job_step_seconds", "Wall time of the latest step"),
    ("phalanx_job_devices", "Devices holding the job's shards"),
    ("phalanx_job_energy_joules", "Energy drawn from the job's phones' batteries (a phone's "
                                  "draw while it charges is not seen: not counted)"),
    ("phalanx_job_last_progress_timestamp_seconds", "Unix time the job last advanced a step"),
)


def job_metrics(session: Session, now: dt.datetime) -> Iterable[Any]:
    jobs = _recent_jobs(session, now)
    held = _job_devices(session, [j.id for j in jobs])
    counts = dict.fromkeys(JOB_STATES, 0)
    for state, n in session.execute(select(Job.state, func.count()).group_by(Job.state)):
        counts[state] = n
    yield _gauge("phalanx_jobs", "Jobs by state", "state", counts)
    info = GaugeMetricFamily("phalanx_job_info", "1 per recent job, with its name and state",
                             labels=["job_id", "name", "state"])
    families = {name: GaugeMetricFamily(name, text, labels=["job_id"]) for name, text in JOB_GAUGES}
    for job in jobs:
        info.add_metric([job.id, job.name, job.state], 1.0)
        for name, value in _job_values(session, job, held.get(job.id, []), now).items():
            if value is not None:
                families[name].add_metric([job.id], float(value))
    yield info
    yield from families.values()


def _job_values(session: Session, job: Job, devices: list[str],
                now: dt.datetime) -> dict[str, float | None]:
    rates = _step_rates(session, job.id)
    metrics = job.metrics or {}
    # from the phones' samples, not the sum of the steps' kept values: those are kept only
    # once final, so their sum lags a running job's
    energy = _energy_cache.get(session, job, devices, now)
    progress = job.step / job.total_steps if job.total_steps else None
    val = _number(metrics.get("val_accuracy"))
    moved = job.step_started_at or job.started_at
    return {
        "phalanx_job_step": job.step,
        "phalanx_job_total_steps": job.total_steps,
        "phalanx_job_progress_ratio": progress,
        "phalanx_job_train_loss": _number(metrics.get("train_loss")),
        "phalanx_job_train_accuracy": _number(metrics.get("train_accuracy")),
        "phalanx_job_val_accuracy": val if val is not None else rates.val_accuracy,
        "phalanx_job_samples_per_second": rates.samples_per_s,
        "phalanx_job_step_seconds": rates.step_seconds,
        "phalanx_job_devices": len(devices),
        "phalanx_job_energy_joules": energy,
        "phalanx_job_last_progress_timestamp_seconds": moved.timestamp() if moved else None,
    }


class EnergyCache:
    """A finished job's energy, once settled, never changes: compute it once per process
    (and until then at each scrape: its phones' last samples arrive with their next heartbeat)."""

    def __init__(self) -> None:
        self._done: dict[tuple[str, dt.datetime], float] = {}

    def get(self, session: Session, job: Job, holders: list[str], now: dt.datetime) -> float:
        key = (job.id, job.finished_at)
        if key in self._done:
            return self._done[key]
        energy = job_energy(session, job, holders, now)
        joules = energy.joules or 0.0
        if energy.final:
            if len(self._done) > 4 * MAX_JOBS:
                self._done.clear()
            self._done[key] = joules
        return joules


_energy_cache = EnergyCache()


class StoreCollector(Collector):
    """Fleet and job gauges from one short read-only session per scrape."""

    def __init__(self, session_factory: sessionmaker[Session],
                 clock: Callable[[], dt.datetime]) -> None:
        self._factory = session_factory
        self._clock = clock

    def collect(self) -> Iterable[Any]:
        with self._factory() as session:
            families = [*fleet_metrics(session), *job_metrics(session, self._clock())]
            session.rollback()
        yield from families
