"""Scheduler task durations, kept where every process can see them.

Celery tasks run in worker processes (often other containers or pods) that Prometheus does not
scrape. So `observe_task` does not keep a per-process registry: it adds each run to a small
histogram in Redis (production) or in this process's memory (embedded mode, where the scheduler
runs inside the API process), and the API's `/metrics` renders that shared histogram at scrape
time. Counts survive worker restarts; a Redis flush looks like a counter reset to Prometheus.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

import redis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from domain.settings import get_settings

log = logging.getLogger(__name__)

TASK_BUCKETS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0,
)
KEY_PREFIX = "phalanx:metrics:task:"
NAMES_KEY = "phalanx:metrics:tasks"
KNOWN_TASKS = ("reconcile", "apply_step")
COUNTS_KEY = "phalanx:metrics:counts"
# counters the scheduler adds to (`count`): name -> (help, label, the label values every scrape
# shows, 0 until counted)
COUNTERS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "phalanx_audits": ("Audited nodes compared with the applied result: agreed, or a mismatch "
                       "(a third device decides)", "outcome", ("agreed", "mismatch")),
    "phalanx_audit_decisions": ("Mismatches decided by a third device: holder_lost, "
                                "auditor_lost, no_majority", "outcome",
                                ("holder_lost", "auditor_lost", "no_majority")),
    "phalanx_quarantines": ("Devices quarantined because an audit found their result wrong, "
                            "by device name", "device", ()),
}


@dataclass
class TaskStats:
    """One task's cumulative histogram and outcome counts."""

    count: int = 0
    total_seconds: float = 0.0
    buckets: list[int] = field(default_factory=lambda: [0] * len(TASK_BUCKETS))
    failures: int = 0
    last_run: float | None = None
    last_success: float | None = None

    def add(self, seconds: float, ok: bool, now: float) -> None:
        self.count += 1
        self.total_seconds += seconds
        for i, bound in enumerate(TASK_BUCKETS):
            if seconds <= bound:
                self.buckets[i] += 1
        self.last_run = now
        if ok:
            self.last_success = now
        else:
            self.failures += 1


class TaskStatsStore(Protocol):
    def add(self, name: str, seconds: float, ok: bool, now: float) -> None: ...

    def read(self) -> dict[str, TaskStats]: ...

    def incr(self, field: str, amount: int) -> None: ...

    def counts(self) -> dict[str, int]: ...


class MemoryTaskStats:
    """Embedded mode: the scheduler and `/metrics` share one process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats: dict[str, TaskStats] = {}
        self._counts: dict[str, int] = {}

    def incr(self, field: str, amount: int) -> None:
        with self._lock:
            self._counts[field] = self._counts.get(field, 0) + amount

    def counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def add(self, name: str, seconds: float, ok: bool, now: float) -> None:
        with self._lock:
            self._stats.setdefault(name, TaskStats()).add(seconds, ok, now)

    def read(self) -> dict[str, TaskStats]:
        with self._lock:
            return {name: TaskStats(s.count, s.total_seconds, list(s.buckets), s.failures,
                                    s.last_run, s.last_success)
                    for name, s in self._stats.items()}


class RedisTaskStats:
    """Production: one Redis hash per task name, updated in one pipelined round trip."""

    def __init__(self, url: str) -> None:
        self._redis = redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=1)

    def incr(self, field: str, amount: int) -> None:
        self._redis.hincrby(COUNTS_KEY, field, amount)

    def counts(self) -> dict[str, int]:
        return {k.decode(): int(v) for k, v in self._redis.hgetall(COUNTS_KEY).items()}

    def add(self, name: str, seconds: float, ok: bool, now: float) -> None:
        key = KEY_PREFIX + name
        pipe = self._redis.pipeline(transaction=False)
        pipe.sadd(NAMES_KEY, name)
        pipe.hincrby(key, "count", 1)
        pipe.hincrbyfloat(key, "sum", seconds)
        for bound in TASK_BUCKETS:
            if seconds <= bound:
                pipe.hincrby(key, f"le:{bound}", 1)
        pipe.hset(key, "last_run", repr(now))
        if ok:
            pipe.hset(key, "last_success", repr(now))
        else:
            pipe.hincrby(key, "failures", 1)
        pipe.execute()

    def read(self) -> dict[str, TaskStats]:
        names = sorted(n.decode() for n in self._redis.smembers(NAMES_KEY))
        pipe = self._redis.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(KEY_PREFIX + name)
        return {name: _parse_hash(raw) for name, raw in zip(names, pipe.execute())}


def _parse_hash(raw: dict[bytes, bytes]) -> TaskStats:
    values = {k.decode(): v.decode() for k, v in raw.items()}

    def opt(name: str) -> float | None:
        return float(values[name]) if name in values else None

    return TaskStats(
        count=int(values.get("count", 0)),
        total_seconds=float(values.get("sum", 0.0)),
        buckets=[int(values.get(f"le:{bound}", 0)) for bound in TASK_BUCKETS],
        failures=int(values.get("failures", 0)),
        last_run=opt("last_run"),
        last_success=opt("last_success"),
    )


_lock = threading.Lock()
_stores: dict[str | None, TaskStatsStore] = {}
_active_url: list[str | None] = []


def stats_store(redis_url: str | None) -> TaskStatsStore:
    """One store per Redis URL (None: this process's memory), shared by the whole process."""
    with _lock:
        store = _stores.get(redis_url)
        if store is None:
            store = RedisTaskStats(redis_url) if redis_url else MemoryTaskStats()
            _stores[redis_url] = store
        return store


def use_redis_url(redis_url: str | None) -> None:
    """Make `observe_task` in this process write where the app's `/metrics` reads."""
    with _lock:
        _active_url[:] = [redis_url]


def active_store() -> TaskStatsStore:
    if _active_url:
        return stats_store(_active_url[0])
    return stats_store(get_settings().redis_url)


def observe_task(name: str, seconds: float, ok: bool) -> None:
    """Add one run; metrics never fail the task they measure."""
    try:
        active_store().add(name, float(seconds), bool(ok), time.time())
    except Exception as exc:  # Redis down or slow: the task itself must not notice
        log.warning("could not record task metric %s: %s", name, exc)


def count(metric: str, label: str, amount: int = 1) -> None:
    """Add to one of COUNTERS (the label's value: `label`); never fails its caller."""
    try:
        active_store().incr(f"{metric}|{label}", int(amount))
    except Exception as exc:  # Redis down or slow: the scheduler must not notice
        log.warning("could not count %s{%s}: %s", metric, label, exc)


def counter_families(counts: dict[str, int]) -> list[CounterMetricFamily]:
    """COUNTERS as Prometheus counters, each with its known label values from the start."""
    families = []
    for metric, (help_text, label, known) in COUNTERS.items():
        values = dict.fromkeys(known, 0)
        for key, n in counts.items():
            name, _, value = key.partition("|")
            if name == metric:
                values[value] = values.get(value, 0) + n
        family = CounterMetricFamily(metric, help_text, labels=[label])
        for value, n in sorted(values.items()):
            family.add_metric([value], float(n))
        families.append(family)
    return families


class TaskCollector(Collector):
    """Renders the shared task histograms at scrape time."""

    def __init__(self, store: TaskStatsStore) -> None:
        self._store = store

    def collect(self) -> Iterable[HistogramMetricFamily | CounterMetricFamily | GaugeMetricFamily]:
        stats = self._store.read()
        for name in KNOWN_TASKS:  # a series from the first scrape on, so rate() and alerts work
            stats.setdefault(name, TaskStats())
        duration = HistogramMetricFamily(
            "phalanx_task_duration_seconds",
            "Scheduler task run time (reconcile, apply_step), from every worker process",
            labels=["task"])
        runs = CounterMetricFamily("phalanx_task_runs", "Scheduler task runs by outcome",
                                   labels=["task", "outcome"])
        last_ok = GaugeMetricFamily("phalanx_task_last_success_timestamp_seconds",
                                    "Unix time of the task's last successful run", labels=["task"])
        for name, s in sorted(stats.items()):
            buckets = [(_le(b), float(c)) for b, c in zip(TASK_BUCKETS, s.buckets)]
            buckets.append(("+Inf", float(s.count)))
            duration.add_metric([name], buckets, s.total_seconds)
            runs.add_metric([name, "ok"], float(s.count - s.failures))
            runs.add_metric([name, "error"], float(s.failures))
            if s.last_success is not None:
                last_ok.add_metric([name], s.last_success)
        yield duration
        yield runs
        yield last_ok
        yield from counter_families(self._store.counts())


def _le(bound: float) -> str:
    return repr(float(bound))
