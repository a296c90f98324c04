"""A job's energy, from its phones' power samples: one rule for the job's Prometheus gauge and
for its per-step curve (`GET /v1/jobs/{id}/metrics`, the job report and page).

It is the energy drawn from the phones' batteries. A sample's `power_w` is the battery's
(V x |I|): on battery that is what the phone draws, but on external power (`charging`: the
agent's "plugged in") it is what flows into the battery, and the phone's own draw comes from the
charger, unseen. So a stretch on external power counts nothing (a plugged rack's jobs show
little or no energy: a USB power meter or a smart plug measures those).

Each phone counts from when it joined the job (its first mention in the job's events, else the
job's start) to the job's end (or now): a phone that left mid-run keeps counting, an upper
bound, exact for a job whose phones never changed. Power is linear between two samples of a
phone and cut at the edges of what is asked (a job, a step), so a step shorter than the phones'
reporting period gets its share; a gap longer than MAX_POWER_GAP_S is skipped (the phone was
away). A value is final once each phone has reported past its end (samples arrive with the
next heartbeat, after the moment they describe), or ENERGY_SETTLE_S after it; a step's value is
shown before that if the phones yet to report have lost their lease.

Times come from the store as UTC-aware datetimes (`domain.store.models.UTCDateTime`).
"""

from __future__ import annotations

import bisect
import datetime as dt
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from domain.store.models import Device, Event, Job, ShardAssignment, TelemetrySample
from wire.states import DeviceState

MAX_POWER_GAP_S = 60.0
# a value is final this long after its end even if a phone never reported past it: samples
# buffered through an outage arrive late (the agent's retries back off to a minute), and a phone
# gone for good must not keep it open forever
ENERGY_SETTLE_S = 600.0

Sample = tuple[str, dt.datetime, float | None]  # (device, ts, watts)
Window = tuple[dt.datetime, dt.datetime]


@dataclass(frozen=True)
class Segment:
    """One phone's power over [start, end], linear: `watts0` at `t0`, `slope` watts a second."""

    start: dt.datetime
    end: dt.datetime
    t0: dt.datetime
    watts0: float
    slope: float

    def joules(self, start: dt.datetime, end: dt.datetime) -> float:
        """The energy over [start, end] (inside this segment)."""
        a, b = (start - self.t0).total_seconds(), (end - self.t0).total_seconds()
        return (b - a) * (2 * self.watts0 + self.slope * (a + b)) / 2


def power_segments(samples: Iterable[Sample], windows: Mapping[str, Window] | None = None,
                   max_gap_s: float = MAX_POWER_GAP_S) -> Iterator[Segment]:
    """The pieces of each phone's power curve inside its window (every piece without windows);
    `samples` in time order per device."""
    last: dict[str, tuple[dt.datetime, float]] = {}
    for device_id, ts, watts in samples:
        if watts is None:  # unknown here: no segment reaches across it
            last.pop(device_id, None)
            continue
        prev = last.get(device_id)
        last[device_id] = (ts, watts)
        if prev is None:
            continue
        gap = (ts - prev[0]).total_seconds()
        if not 0 < gap <= max_gap_s:
            continue
        start, end = prev[0], ts
        if windows is not None:
            if device_id not in windows:
                continue
            start, end = max(start, windows[device_id][0]), min(end, windows[device_id][1])
        if end > start:
            yield Segment(start, end, prev[0], prev[1], (watts - prev[1]) / gap)


def battery_draw(power_w: float | None, charging: bool | None) -> float | None:
    """What a sample says the phone drew from its battery: nothing known on external power."""
    return None if charging else power_w


def integrate_power(samples: Iterable[Sample], windows: Mapping[str, Window] | None = None,
                    max_gap_s: float = MAX_POWER_GAP_S) -> float:
    """Joules from (device, ts, watts) samples in time order per device, inside `windows`."""
    return sum(s.joules(s.start, s.end) for s in power_segments(samples, windows, max_gap_s))


def energy_between(samples: Iterable[Sample], windows: Mapping[str, Window],
                   edges: Sequence[dt.datetime]) -> list[float]:
    """Joules in each interval [edges[i], edges[i + 1]] (edges in time order)."""
    out = [0.0] * max(len(edges) - 1, 0)
    for seg in power_segments(samples, windows):
        i = max(bisect.bisect_right(edges, seg.start) - 1, 0)
        while i < len(out) and edges[i] < seg.end:
            start, end = max(seg.start, edges[i]), min(seg.end, edges[i + 1])
            if end > start:
                out[i] += seg.joules(start, end)
            i += 1
    return out


def device_starts(session: Session, job: Job, holders: Iterable[str]) -> dict[str, dt.datetime]:
    """When each phone began working for the job: its first mention in the job's events
    (`device_id`, or `data["devices"]` of Scheduled/ShardsMoved), else the job's start."""
    began = job.started_at or job.created
    starts = {device: began for device in holders}
    rows = session.execute(select(Event.ts, Event.device_id, Event.data)
                           .where(Event.job_id == job.id).order_by(Event.ts)).all()
    named: dict[str, dt.datetime] = {}
    for ts, device_id, data in rows:
        listed = (data or {}).get("devices") if isinstance(data, dict) else None
        for device in [device_id, *(listed if isinstance(listed, list) else [])]:
            if isinstance(device, str) and device not in named:
                named[device] = max(ts, began)
    return {**starts, **named}


@dataclass(frozen=True)
class JobPower:
    """A job's phones, their windows and their samples (those either side of the windows too)."""

    windows: dict[str, Window]
    samples: list[Sample]
    latest: dict[str, dt.datetime]  # each phone's newest sample among them
    away: frozenset[str]  # phones whose lease has expired, or gone from the fleet

    def final(self, until: dt.datetime, now: dt.datetime) -> bool:
        """No sample still to arrive can change the energy up to `until`: each phone has
        reported past it, or it is ENERGY_SETTLE_S ago."""
        return (now - until).total_seconds() > ENERGY_SETTLE_S or self._reported(until)

    def settled(self, until: dt.datetime, now: dt.datetime) -> bool:
        """Worth showing: final, or each phone that has not reported past `until` is away (a
        dead phone is not waited for; one that comes back with buffered samples adds them)."""
        return self.final(until, now) or self._reported(until, excused=self.away)

    def _reported(self, until: dt.datetime, excused: frozenset[str] = frozenset()) -> bool:
        return all(d in excused or (d in self.latest and self.latest[d] >= min(until, end))
                   for d, (start, end) in self.windows.items() if start < until)


def job_power(session: Session, job: Job, holders: Iterable[str], now: dt.datetime,
              between: Window | None = None) -> JobPower:
    """`between`: only the samples needed for that stretch of the job."""
    if job.started_at is None:
        return JobPower({}, [], {}, frozenset())
    end = job.finished_at or now
    windows = {d: (start, end) for d, start in device_starts(session, job, holders).items()}
    if not windows:
        return JobPower({}, [], {}, frozenset())
    first, last = between or (min(start for start, _ in windows.values()), end)
    margin = dt.timedelta(seconds=MAX_POWER_GAP_S)  # the samples either side of each window
    rows = session.execute(
        select(TelemetrySample.device_id, TelemetrySample.ts, TelemetrySample.power_w,
               TelemetrySample.charging)
        .where(TelemetrySample.device_id.in_(list(windows)),
               TelemetrySample.ts >= first - margin, TelemetrySample.ts <= last + margin)
        .order_by(TelemetrySample.device_id, TelemetrySample.ts)).all()
    samples = [(d, ts, battery_draw(w, charging)) for d, ts, w, charging in rows]
    present = session.scalars(select(Device.id).where(
        Device.id.in_(list(windows)), Device.state != DeviceState.NOT_READY.value))
    return JobPower(windows, samples, {d: ts for d, ts, _ in samples},  # in time order per phone
                    frozenset(windows) - frozenset(present))


@dataclass(frozen=True)
class Energy:
    joules: float | None  # None: not known yet (a phone may still report), or no longer
    final: bool  # no sample still to arrive would change it: it may be kept


def job_energy(session: Session, job: Job, holders: list[str], now: dt.datetime) -> Energy:
    """Joules drawn by the job's phones, each from when it joined to the job's end (or now);
    final once the job has ended and every phone has reported past the end."""
    power = job_power(session, job, holders, now)
    return Energy(integrate_power(power.samples, power.windows),
                  job.finished_at is not None and power.final(job.finished_at, now))


def step_energy(session: Session, job: Job, begin: dt.datetime | None,
                ends: Sequence[dt.datetime], now: dt.datetime,
                known_since: dt.datetime) -> list[Energy]:
    """The energy of each step whose commit was at `ends[i]` (the step ran from the previous
    commit, `begin` for the first, or the job's start): unknown while a phone may still report
    past the step's end, and for a step older than `known_since` (its samples are pruned)."""
    if not ends or job.started_at is None:
        return [Energy(None, False)] * len(ends)
    edges = [begin or job.started_at]
    for ts in ends:  # replicas' clocks may differ by a little: never backwards
        edges.append(max(ts, edges[-1]))
    holders = session.scalars(select(ShardAssignment.device_id)
                              .where(ShardAssignment.job_id == job.id).distinct())
    power = job_power(session, job, holders, now, between=(edges[0], edges[-1]))
    joules = energy_between(power.samples, power.windows, edges)
    return [Energy(j, power.final(end, now)) if start >= known_since and power.settled(end, now)
            else Energy(None, False)
            for j, start, end in zip(joules, edges, edges[1:])]
