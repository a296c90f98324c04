"""`AgentRuntime`: the whole agent (heartbeat thread + work loop) as a library entry point.

    stop = threading.Event()
    AgentRuntime("/path/config.json").run(stop)   # returns when stop is set or the token dies

The CLI's `phalanx-agent run` is this plus signal handling; simulated phones (`phalanx sim`,
the demo) run it in threads or subprocesses with their own config, PHALANX_SYSFS_ROOT tree and
fake `termux-battery-status`.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agent.client import Client
from agent.config import AgentConfig, clean_temp_files, load, save
from agent.hardware import backends as installed_backends
from agent.probes import Probes
from agent.probes.busy import own_cpu_s
from agent.probes.cpu import clusters, read_cores
from agent.runtime import choice, logring
from agent.runtime.buffer import TelemetryBuffer
from agent.runtime.cache import WorkCache
from agent.runtime.execution import ExecutionManager
from agent.runtime.executor import ExecConfig
from agent.runtime.guard import Limits, PhoneGuard
from agent.runtime.heartbeat import HeartbeatLoop
from agent.runtime.ledger import UploadLedger
from agent.runtime.monitor import Monitor
from agent.runtime.state import AgentState
from agent.runtime.upgrader import Upgrader
from agent.runtime.work import WorkLoop
from agent.slots import Slots

log = logging.getLogger(__name__)
ARCHS = ["logreg", "mlp", "cnn", "mobilenet_v1", "resnet", "resnet18", "resnet50",
         "mobilenet_v2"]
# `portable`: this agent computes a job's portable shards (engine.kernels), the same bits on
# any CPU; an older one computes only the `class` path
FEATURES = ("augment", "label_smoothing", "upload_precision", "portable")
FACT_MAX = 64  # the control plane's bound on one compute-class fact (api.schemas.devices)


def compute_class() -> dict[str, Any] | None:
    """This machine's compute class (engine.compute_class.describe(), ~20 ms the first time,
    then cached there), its facts cut to what the control plane takes; None when the engine
    cannot say (a heartbeat without it still goes: placement keeps class jobs off this phone)."""
    try:
        from engine.compute_class import describe

        facts = describe()
    except Exception:  # noqa: BLE001 - a probe: a phone without it still serves portable jobs
        log.warning("could not tell this machine's compute class", exc_info=True)
        return None

    fingerprint = facts.get("fingerprint")
    if not isinstance(fingerprint, str) or not re.fullmatch(r"[0-9a-f]{16}", fingerprint):
        log.warning("compute class fingerprint %r is not 16 hex digits: not reported",
                    fingerprint)
        return None

    def fact(value: Any) -> str | None:
        return None if value is None else str(value)[:FACT_MAX]

    blas = facts.get("blas") if isinstance(facts.get("blas"), dict) else {}
    return {"machine": fact(facts.get("machine")) or "", "numpy": fact(facts.get("numpy")) or "",
            "blas": {k: fact(blas.get(k)) for k in ("library", "version", "kernel")},
            "simd": fact(facts.get("simd")),
            "simd_features": min(1024, max(0, int(facts.get("simd_features") or 0))),
            "fingerprint": fingerprint}


class AgentStopped(Exception):
    """The agent stopped for good (token revoked, device deleted); the message says why."""


class AgentRuntime:
    def __init__(self, config_path: str | Path, *, probes: Probes | None = None,
                 candidates: Callable[[], list[ExecConfig]] | None = None,
                 work_wait_s: float | None = None) -> None:
        self.config_path = Path(config_path).expanduser()
        self.config: AgentConfig = load(self.config_path)
        cfg = self.config
        state_dir = cfg.state_path(self.config_path)
        state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        clean_temp_files(self.config_path)
        self.state = AgentState()
        logring.install()  # recent lines, shipped when an operator asks (phalanx devices logs)
        self.execution: ExecutionManager | None = None
        self.probes = probes or Probes(termux_timeout_s=cfg.termux_timeout_s,
                                       own_cpu=self._own_cpu)
        self.monitor = Monitor(self.probes.read, PhoneGuard(busy_quiet_s=cfg.busy_quiet_s),
                               limits=Limits(shared_mode=cfg.shared_mode))
        self.client = Client(cfg.server, cfg.device_token, timeout_s=cfg.request_timeout_s,
                             socket_buffer_bytes=cfg.socket_buffer_bytes,
                             ca_file=cfg.ca_file or None)
        self.backends = [b for b in installed_backends() if not cfg.backends or b in cfg.backends]
        self._compute_class: dict[str, Any] | None = None  # computed at the first heartbeat
        # power is sampled while profiling only when a limit makes it matter: each reading
        # runs termux-battery-status, which costs a phone ~0.5 s
        metered = cfg.power_limit_w is not None
        self.execution = ExecutionManager(candidates or self._candidates,
                                          read_power=self.monitor.power_w if metered else None,
                                          power_limit_w=cfg.power_limit_w)
        self.upgrader = Upgrader(self.client, cfg.device_id, Slots.from_env(),
                                 busy=lambda: self.state.working)
        self.heartbeat = HeartbeatLoop(self.client, cfg.device_id, self.monitor, self.state,
                                       TelemetryBuffer(cfg.telemetry_buffer), self.capabilities,
                                       interval_s=cfg.heartbeat_interval_s,
                                       rotate_token=self._rotate_token,
                                       ship_logs=self._ship_logs, upgrader=self.upgrader)
        self.work = WorkLoop(self.client, cfg.device_id, self.monitor, self.state,
                             WorkCache(state_dir / "cache", cfg.cache_max_shard_bytes),
                             UploadLedger(state_dir / "uploads.jsonl"),
                             self.execution, shared_default=cfg.shared_mode,
                             wait_s=work_wait_s if work_wait_s is not None else cfg.work_wait_s)

    def _ship_logs(self) -> None:
        """The recent lines (logring.RING), asked for by the control plane: the newest that fit
        one request (the server takes 1 MiB; escaped non-ASCII text can triple a line)."""
        self.client.ship_logs(self.config.device_id, logring.fitting(logring.RING.snapshot()))

    def _rotate_token(self) -> None:
        """A new device token, saved (atomically, 0600) before it is used: after a crash in
        between, the config's old token still works for the server's grace period, and the
        next heartbeat asks for a rotation again."""
        reply = self.client.rotate_token(self.config.device_id)
        token = reply.get("device_token") if isinstance(reply, dict) else None
        if not isinstance(token, str) or not token:
            log.warning("token rotation answered without a token; the next heartbeat asks again")
            return
        previous = self.config.device_token
        self.config.device_token = token
        try:
            save(self.config_path, self.config)
        except OSError as exc:  # disk full: keep the old token (it works for the grace period)
            self.config.device_token = previous
            log.warning("could not save the rotated token (%s); the next heartbeat asks again",
                        exc)
            return
        self.client.token = token
        log.info("device token rotated; the old one works until %s",
                 reply.get("previous_token_expires_at"))

    def _own_cpu(self) -> float:
        worker = self.execution.worker if self.execution else None
        return own_cpu_s([worker.pid] if worker else [])

    def _candidates(self) -> list[ExecConfig]:
        return choice.candidates(clusters(read_cores(self.probes.fs)), self.backends)

    def capabilities(self) -> dict[str, Any]:
        try:
            from engine.models import ARCHS as archs
            from engine.models import CUSTOM
        except ImportError:  # engine unusable here: say what we were built for
            archs, CUSTOM = tuple(ARCHS), "custom"
        # `custom`: this agent builds a job's own layer graph (an older one never says so);
        # `features`: what it computes beyond an arch (scheduler.policy.types.job_features)
        # `self_upgrade`: started by launch.sh, it can install a rollout and roll it back
        # (an agent started otherwise, or older, is never told to upgrade)
        upgrade = ["self_upgrade"] if self.upgrader.slots is not None else []
        caps: dict[str, Any] = {"backends": self.backends, "archs": [*archs, CUSTOM],
                                "features": [*FEATURES, *upgrade]}
        # `compute_class`: the machine a `class` job's shards must share (computed once)
        if self._compute_class is None:
            self._compute_class = compute_class() or {}
        if self._compute_class:
            caps["compute_class"] = self._compute_class
        return caps

    def run(self, stop: threading.Event | None = None, shutdown_grace_s: float = 5.0) -> None:
        """Run until `stop` is set; raises AgentStopped if the control plane cut us off.

        The work loop may sit in a 30 s long poll that urllib cannot interrupt, so it runs in
        its own daemon thread: after `stop`, it gets `shutdown_grace_s` to finish what it is
        doing, and is otherwise abandoned (what it had not uploaded is recomputed, as after
        a kill)."""
        stop = stop or threading.Event()
        threads = [threading.Thread(target=self.heartbeat.run, args=(stop,), daemon=True,
                                    name="phalanx-heartbeat"),
                   threading.Thread(target=self.work.run, args=(stop,), daemon=True,
                                    name="phalanx-work")]
        for t in threads:
            t.start()
        try:
            while not stop.is_set() and all(t.is_alive() for t in threads):
                stop.wait(0.5)
        finally:
            stop.set()
            deadline = time.monotonic() + shutdown_grace_s
            for t in threads:
                t.join(timeout=max(0.0, deadline - time.monotonic()))
            if self.execution:
                self.execution.close()
        if self.state.fatal:
            raise AgentStopped(self.state.fatal)
