"""What the swarm measures: latency histograms and answers by status, per endpoint, for the
whole run and for each one-second window.

A histogram of log-spaced buckets (32 per doubling, about 2% wide) from 10 µs to ~20 min: adding
a latency is one `log2`, a percentile is a walk over ~1,000 counters, so the percentiles of
millions of requests cost nothing to keep and can be printed every second.
"""

from __future__ import annotations

import math
import resource
import time
from array import array
from collections import Counter
from typing import Any

FLOOR_S = 1e-5
PER_DOUBLING = 32
BUCKETS = 27 * PER_DOUBLING  # 1e-5 * 2**27 s = 22 min


class LatencyHistogram:
    __slots__ = ("counts", "n", "max_s")

    def __init__(self) -> None:
        self.counts = array("Q", bytes(8 * BUCKETS))
        self.n = 0
        self.max_s = 0.0

    def add(self, seconds: float) -> None:
        i = int(math.log2(seconds / FLOOR_S) * PER_DOUBLING) if seconds > FLOOR_S else 0
        self.counts[i if i < BUCKETS else BUCKETS - 1] += 1
        self.n += 1
        if seconds > self.max_s:
            self.max_s = seconds

    def merge(self, other: LatencyHistogram) -> None:
        for i, c in enumerate(other.counts):
            if c:
                self.counts[i] += c
        self.n += other.n
        self.max_s = max(self.max_s, other.max_s)

    def percentile(self, q: float) -> float:
        """The upper edge of the bucket holding the q-quantile (seconds), capped at the max."""
        if not self.n:
            return 0.0
        rank, seen = max(1, math.ceil(q * self.n)), 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen >= rank:
                return min(self.max_s, FLOOR_S * 2 ** ((i + 1) / PER_DOUBLING))
        return self.max_s

    def sparse(self) -> dict[int, int]:
        """The counts that are not zero, by bucket: what `from_sparse` reads back."""
        return {i: c for i, c in enumerate(self.counts) if c}

    @classmethod
    def from_sparse(cls, counts: dict[Any, int], max_s: float = 0.0) -> LatencyHistogram:
        hist = cls()
        for i, c in counts.items():
            hist.counts[int(i)] += c
            hist.n += c
        top = max((int(i) for i in counts), default=-1)
        hist.max_s = max_s or (FLOOR_S * 2 ** ((top + 1) / PER_DOUBLING) if top >= 0 else 0.0)
        return hist

    def summary_ms(self) -> dict[str, float]:
        if not self.n:
            return {}
        return {"p50": round(1000 * self.percentile(0.5), 2),
                "p95": round(1000 * self.percentile(0.95), 2),
                "p99": round(1000 * self.percentile(0.99), 2),
                "max": round(1000 * self.max_s, 2)}


def cpu_s() -> float:
    """User + system CPU seconds of this process so far."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Tally:
    """Answers by endpoint and status (`200`, `503`, or a transport error's kind: `refused`),
    with a latency histogram per endpoint of the answered ones."""

    __slots__ = ("statuses", "latency")

    def __init__(self) -> None:
        self.statuses: dict[str, Counter[str]] = {}
        self.latency: dict[str, LatencyHistogram] = {}

    def record(self, endpoint: str, status: str, seconds: float | None) -> None:
        counts = self.statuses.get(endpoint)
        if counts is None:
            counts = self.statuses[endpoint] = Counter()
            self.latency[endpoint] = LatencyHistogram()
        counts[status] += 1
        if seconds is not None:
            self.latency[endpoint].add(seconds)

    def requests(self, endpoint: str | None = None) -> int:
        if endpoint is not None:
            return sum(self.statuses.get(endpoint, {}).values())
        return sum(sum(c.values()) for c in self.statuses.values())

    def ok(self, endpoint: str) -> int:
        return sum(n for s, n in self.statuses.get(endpoint, {}).items() if s[:1] == "2")

    def errors(self) -> Counter[str]:
        """`endpoint: status` for every answer that was not 2xx and every transport error."""
        out: Counter[str] = Counter()
        for ep, counts in self.statuses.items():
            for status, n in counts.items():
                if status[:1] != "2":
                    out[f"{ep}: {status}"] += n
        return out


class SwarmStats:
    """The whole run's tally and the current window's; `roll` closes a window."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.finished: float | None = None
        self.total = Tally()
        self.window = Tally()
        self.window_started = self.started
        self.lag = LatencyHistogram()  # due -> sent: the simulator's own delay
        self.window_lag = LatencyHistogram()
        self.cpu_at_start = cpu_s()
        self.window_cpu = self.cpu_at_start
        self.enrolled = 0
        self.retries = 0
        self.commands: Counter[str] = Counter()
        self.states: Counter[str] = Counter()  # the device state each accepted heartbeat said
        self.assignments = 0
        self.notes: dict[str, str] = {}  # the first detail of each kind of refusal

    def record(self, endpoint: str, status: str, seconds: float | None) -> None:
        self.total.record(endpoint, status, seconds)
        self.window.record(endpoint, status, seconds)

    def record_lag(self, seconds: float) -> None:
        self.lag.add(seconds)
        self.window_lag.add(seconds)

    @property
    def elapsed_s(self) -> float:
        return (self.finished or time.monotonic()) - self.started

    def roll(self, **extra: Any) -> dict[str, Any]:
        """The window just ended as one JSON-ready line, and a new window."""
        now, cpu = time.monotonic(), cpu_s()
        span = max(1e-9, now - self.window_started)
        w = self.window
        hb = w.latency.get("heartbeat")
        line = {"t": round(now - self.started, 1), "wall": round(time.time(), 2),
                "span_s": round(span, 2), "enrolled": self.enrolled,
                "heartbeats_ok": w.ok("heartbeat"),
                "heartbeats_per_s": round(w.requests("heartbeat") / span, 1),
                "heartbeat_ms": hb.summary_ms() if hb else {},
                "heartbeat_hist": hb.sparse() if hb else {},  # LatencyHistogram.from_sparse
                "registered": w.ok("register"),
                "statuses": {ep: dict(c) for ep, c in sorted(w.statuses.items())},
                "lag_p99_ms": round(1000 * self.window_lag.percentile(0.99), 1),
                "cpu": round((cpu - self.window_cpu) / span, 3), **extra}
        self.window, self.window_started, self.window_cpu = Tally(), now, cpu
        self.window_lag = LatencyHistogram()
        return line

    def report(self) -> dict[str, Any]:
        """The run's report, in `phalanx.sim.fleet.FleetStats.report`'s shape and more."""
        elapsed = self.elapsed_s
        total = self.total.requests()
        every = LatencyHistogram()
        for hist in self.total.latency.values():
            every.merge(hist)
        errors = self.total.errors()
        used = cpu_s() - self.cpu_at_start
        return {
            "mode": "swarm",
            "phones_enrolled": self.enrolled,
            "requests": total,
            "elapsed_s": round(elapsed, 2),
            "requests_per_s": round(total / elapsed, 1) if elapsed > 0 else 0.0,
            "errors": sum(errors.values()),
            "errors_by_kind": dict(errors),
            "retries": self.retries,
            "latency_ms": every.summary_ms(),
            "endpoints": {ep: {"requests": self.total.requests(ep),
                               "latency_ms": self.total.latency[ep].summary_ms(),
                               "statuses": dict(self.total.statuses[ep])}
                          for ep in sorted(self.total.statuses)},
            "lag_ms": self.lag.summary_ms(),
            "cpu_s": round(used, 1),
            "cpu_share": round(used / elapsed, 3) if elapsed > 0 else 0.0,
            "cpu_us_per_request": round(1e6 * used / total, 1) if total else None,
            "commands": dict(self.commands),
            "states": dict(self.states),
            "assignments": self.assignments,
            "refusals": dict(self.notes),
        }
