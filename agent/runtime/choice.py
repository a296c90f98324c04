"""Execution choice, after Swan (arXiv 2206.04687): measure, don't guess.

Candidates are (backend, core set, thread count). Core sets come from the big.LITTLE clusters
(`little` = the slowest cluster, `big` = every faster core, `all`), limited to the CPUs this
process may use. Each candidate runs the job's own model on a real shard; the fastest wins, or,
under a power limit with power readable, the most samples per joule among those under the limit.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from agent.runtime.executor import ComputeFailed, Diverged, ExecConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Measurement:
    config: ExecConfig
    samples_per_s: float
    power_w: float | None = None

    @property
    def samples_per_joule(self) -> float | None:
        return self.samples_per_s / self.power_w if self.power_w else None


def allowed_cpus() -> set[int]:
    if hasattr(os, "sched_getaffinity"):
        try:
            return set(os.sched_getaffinity(0))
        except OSError:
            pass
    return set(range(os.cpu_count() or 1))


def core_sets(clusters: list[dict[str, Any]], allowed: set[int]) -> list[tuple[str, tuple[int, ...]]]:
    """`[(label, cores)]`: all, then big and little where the phone has more than one cluster."""
    every = tuple(sorted(allowed))
    sets: list[tuple[str, tuple[int, ...]]] = [("all", every)]
    groups = [tuple(c for c in cl.get("cores", []) if c in allowed) for cl in clusters]
    groups = [g for g in groups if g]
    if len(groups) > 1:
        little = groups[0]
        big = tuple(sorted(c for g in groups[1:] for c in g))
        sets += [("big", big), ("little", little)]
    return sets


REFERENCE_BACKEND = "numpy"  # every agent has it; `phalanx train --local` defaults to it


def job_backend(spec: dict[str, Any] | None) -> str:
    """The one backend every phone of a job computes with.

    numpy and torch round differently, and SGD amplifies a 1e-7 difference to ~1e-3 in the loss
    within a hundred steps, so a gang mixing them would leave the reference trajectory
    (invariant 1). `placement.backend: torch` asks for torch (placed on torch phones only);
    `any` (the default) means numpy, which every phone has."""
    wanted = str(((spec or {}).get("placement") or {}).get("backend") or "any")
    return wanted if wanted in ("numpy", "torch") else REFERENCE_BACKEND


def candidates(clusters: list[dict[str, Any]], backends: list[str],
               allowed: set[int] | None = None, limit: int = 8) -> list[ExecConfig]:
    """Most promising first (every core set at full threads, then half, then one), backends
    interleaved, so a small `limit` still tries each backend and each core set."""
    sets = core_sets(clusters, allowed or allowed_cpus())
    per_backend: list[list[ExecConfig]] = []
    for backend in backends:
        seen: list[ExecConfig] = []
        for level in (1, 2, 0):  # full, half, single thread
            for label, cores in sets:
                threads = len(cores) if level == 1 else max(1, len(cores) // 2) if level == 2 else 1
                if backend == "numpy":
                    threads = 1  # numpy's BLAS runs on one thread (executor.blas_threads)
                cfg = ExecConfig(backend, threads, None if label == "all" else cores, label)
                if cfg not in seen:
                    seen.append(cfg)
        per_backend.append(seen)
    merged = [cfg for group in zip(*per_backend) for cfg in group]
    return merged[:limit]


def choose(results: list[Measurement], power_limit_w: float | None = None) -> Measurement:
    """The fastest; under a power limit (power known) the most efficient within the limit."""
    if not results:
        raise ValueError("no execution candidate could be measured")
    if power_limit_w is not None:
        metered = [m for m in results if m.power_w is not None]
        within = [m for m in metered if m.power_w <= power_limit_w]  # type: ignore[operator]
        if within:
            return max(within, key=lambda m: m.samples_per_joule or 0.0)
        if metered:
            return min(metered, key=lambda m: m.power_w)  # type: ignore[arg-type, return-value]
    return max(results, key=lambda m: m.samples_per_s)


class PowerMeter:
    """Average power over a measurement, sampled from the probes in a background thread."""

    def __init__(self, read_power: Callable[[], float | None], every_s: float = 0.5) -> None:
        self.read_power, self.every_s = read_power, every_s
        self._values: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="power-meter")

    def _run(self) -> None:
        while not self._stop.is_set():
            value = self.read_power()
            if value is not None:
                self._values.append(value)
            self._stop.wait(self.every_s)

    def __enter__(self) -> PowerMeter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    @property
    def mean_w(self) -> float | None:
        return sum(self._values) / len(self._values) if self._values else None


def profile(configs: list[ExecConfig], measure: Callable[[ExecConfig], float],
            read_power: Callable[[], float | None] | None = None) -> list[Measurement]:
    """Measure each config (samples/s); one that fails is left out, not fatal (but a result
    that is not finite is the job's, not the config's: Diverged goes up; and when no config
    computes the shard because the engine raised, that error is the job's: ComputeFailed goes
    up)."""
    results = []
    failed: ComputeFailed | None = None
    for config in configs:
        try:
            if read_power is None:
                results.append(Measurement(config, measure(config)))
                continue
            with PowerMeter(read_power) as meter:
                speed = measure(config)
            results.append(Measurement(config, speed, meter.mean_w))
        except Diverged:
            raise  # the shard's result is not finite whatever the config: the job diverged
        except Exception as exc:  # a config the phone refuses (e.g. no torch) is just not chosen
            log.warning("execution candidate %s failed: %s", config.describe(), exc)
            if isinstance(exc, ComputeFailed):  # more threads, more memory: maybe this one's
                failed = failed or exc
    if not results and failed is not None:
        raise failed
    return results
