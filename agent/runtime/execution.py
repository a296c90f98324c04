"""Keeps the compute worker for the current job's chosen execution config, re-choosing when
the job's model changes, when the phone throttles, or when the control plane asks."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from agent.runtime import choice
from agent.runtime.executor import ComputeWorker, ExecConfig

log = logging.getLogger(__name__)


class ExecutionManager:
    def __init__(self, configs: Callable[[], list[ExecConfig]],
                 read_power: Callable[[], float | None] | None = None,
                 power_limit_w: float | None = None, bench_repeats: int = 2,
                 reprofile_min_s: float = 300.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.configs, self.read_power = configs, read_power
        self.power_limit_w, self.bench_repeats = power_limit_w, bench_repeats
        self.reprofile_min_s, self.clock = reprofile_min_s, clock
        self.worker: ComputeWorker | None = None
        self.model_key: str | None = None
        self.chosen: choice.Measurement | None = None
        self.results: list[choice.Measurement] = []
        self._profiled_at = -1e18

    def ready(self) -> bool:
        """Whether a chosen worker is there to compute (else a profile must come first)."""
        return self.worker is not None and self.worker.alive()

    def needs_profile(self, model_key: str, throttled_now: bool, requested: bool) -> bool:
        if self.worker is None or not self.worker.alive() or model_key != self.model_key:
            return True
        recent = self.clock() - self._profiled_at < self.reprofile_min_s
        return (throttled_now or requested) and not recent

    def profile(self, model_key: str, bench_req: dict[str, Any],
                backend: str | None = None) -> choice.Measurement:
        """Try every candidate (of `backend`, when given: the job's) on `bench_req` (the job's
        model, a real shard); keep the best."""
        configs = [c for c in self.configs() if backend is None or c.backend == backend]
        if not configs:
            raise RuntimeError(f"this agent cannot run the job's backend {backend!r}")
        self.close()
        kept: dict[ExecConfig, ComputeWorker] = {}  # only the fastest so far stays alive
        speeds: dict[ExecConfig, float] = {}

        def measure(cfg: ExecConfig) -> float:
            worker = ComputeWorker(cfg)
            try:
                reply = worker.request({**bench_req, "op": "bench",
                                        "repeats": self.bench_repeats})
            except BaseException:
                worker.close()
                raise
            speeds[cfg] = reply["samples"] / max(reply["seconds"], 1e-9)
            best_so_far = max(speeds, key=speeds.__getitem__)
            kept[cfg] = worker
            for other in [c for c in kept if c != best_so_far]:
                kept.pop(other).close()  # its helpers too: a phone holds one set of workers
            return speeds[cfg]

        try:
            self.results = choice.profile(configs, measure, self.read_power)
            best = choice.choose(self.results, self.power_limit_w)
        except BaseException:
            for worker in kept.values():
                worker.close()
            raise
        if best.config not in kept:  # chosen for power, not speed: started again
            for worker in kept.values():
                worker.close()
            kept = {best.config: ComputeWorker(best.config)}
        self.worker = kept[best.config]
        self.chosen, self.model_key, self._profiled_at = best, model_key, self.clock()
        log.info("execution choice for %s: %s at %.1f samples/s (of %d tried)", model_key,
                 best.config.describe(), best.samples_per_s, len(self.results))
        return best

    def step(self, req: dict[str, Any]) -> dict[str, Any]:
        assert self.worker is not None, "profile() first"
        return self.worker.request({**req, "op": "step"})

    def report(self) -> dict[str, Any]:
        if self.chosen is None:
            return {}
        cfg = self.chosen.config
        out: dict[str, Any] = {"samples_per_s": round(self.chosen.samples_per_s, 2),
                               "threads": cfg.threads, "cores": list(cfg.cores or ()) or None,
                               "backend": cfg.backend, "core_set": cfg.label,
                               "pinned": bool(self.worker and self.worker.pinned)}
        if self.chosen.power_w is not None:
            out["power_w"] = round(self.chosen.power_w, 2)
        return out

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()
            self.worker = None
