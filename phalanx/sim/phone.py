"""A simulated phone running the REAL agent: `python -m agent enroll|run` as a subprocess.

Each phone has its own folder: the agent config, a `PHALANX_SYSFS_ROOT` tree, a `bin/` with
`termux-battery-status` and `getprop`, the slowdown file, its log, and a `NetLink` through which
the agent reaches the server. `PhoneRack` ticks every phone's physics in one thread: the load
is what the agent's process tree really used on this machine (CPU seconds per second, times the
phone's slowdown, since the agent's slowdown sleep stands for compute the phone would be doing),
so a phone warms while it trains and cools while it waits.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from phalanx.sim.model import PhoneModel
from phalanx.sim.netproxy import NetLink
from phalanx.sim.profiles import Profile
from phalanx.sim.tree import PhoneFiles

FULL_LOAD_CORES = 0.25  # host cores a training agent uses when it counts as fully loaded


@dataclass
class PhoneOptions:
    battery_pct: float = 80.0
    plugged: bool = True
    rooted: bool = True
    time_scale: float = 10.0
    labels: dict[str, str] = field(default_factory=dict)
    seed: int = 0
    lie: str | None = None  # a liar (phalanx.sim.liar: MODE[:EVERY[:FROM_STEP]]); None: honest


class SimulatedPhone:
    def __init__(self, name: str, profile: Profile, home: Path,
                 options: PhoneOptions | None = None) -> None:
        opts = options or PhoneOptions()
        self.name, self.profile, self.options = name, profile, opts
        self.home = Path(home)
        self.model = PhoneModel(profile, battery_pct=opts.battery_pct, plugged=opts.plugged,
                                time_scale=opts.time_scale, seed=opts.seed)
        self.files = PhoneFiles(self.home, rooted=opts.rooted)
        self.files.install(self.model)
        self.config_path = self.home / "agent" / "config.json"
        self.log_path = self.home / "agent.log"
        self.link: NetLink | None = None
        self.process: subprocess.Popen[bytes] | None = None
        self.device_id: str | None = None
        self._cpu_last: tuple[float, float] | None = None

    # -- the agent ---------------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        env = self.files.env({k: v for k, v in os.environ.items()
                              if not k.startswith("PHALANX_")})
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def _agent(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "agent", *args, "--config", str(self.config_path)]

    def enroll(self, server_url: str, token: str, timeout_s: float = 120.0) -> str:
        """`phalanx-agent enroll` through this phone's network link; returns the device id."""
        self.link = self.link or NetLink(server_url)
        args = ["enroll", "--server", self.link.url, "--token", token, "--name", self.name]
        for key, value in self.options.labels.items():
            args += ["--label", f"{key}={value}"]
        done = subprocess.run(self._agent(*args), env=self.env(), capture_output=True, text=True,
                              timeout=timeout_s, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"{self.name}: enroll failed ({done.returncode}): "
                               f"{done.stderr.strip() or done.stdout.strip()}")
        self.device_id = str(json.loads(done.stdout.strip().splitlines()[-1])["device_id"])
        return self.device_id

    def start(self) -> None:
        """`phalanx-agent run` in the background (again after a kill: Android restarts it)."""
        if self.alive:
            return
        self.model.state.faults.dead = False
        run = self._agent("run")
        if self.options.lie:  # the same agent, its uploads corrupted on the way out
            run[1:3] = ["-m", "phalanx.sim.liar", "--lie", self.options.lie]
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(run, env=self.env(), stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        self._cpu_last = None

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        """The phone dies: SIGKILL to the agent and its compute worker, no goodbye."""
        self.model.state.faults.dead = True
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=10)

    def terminate(self) -> None:
        """Ask the agent to stop (SIGTERM); `stop` waits for it."""
        if self.process is not None and self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.process.pid, signal.SIGTERM)

    def stop(self, timeout_s: float = 5.0) -> None:
        """A clean shutdown (SIGTERM, SIGKILL after `timeout_s`), and the network link closed."""
        self.terminate()
        if self.process is not None and self.process.poll() is None:
            try:
                self.process.wait(timeout=max(0.0, timeout_s))
            except subprocess.TimeoutExpired:
                self.kill()
        if self.link is not None:
            self.link.close()

    # -- faults ----------------------------------------------------------------------------
    def heat(self, extra_c: float = 20.0) -> None:
        self.model.heat(extra_c)

    def cool(self) -> None:
        self.model.cool()

    def unplug(self) -> None:
        self.model.unplug()

    def plug(self) -> None:
        self.model.plug()

    def set_online(self, online: bool) -> None:
        self.model.state.faults.offline = not online
        if self.link is not None:
            self.link.set_online(online)

    # -- physics -----------------------------------------------------------------------------
    def _cpu_seconds(self) -> float:
        if not self.alive or self.process is None:
            return 0.0
        total = 0.0
        try:
            root = psutil.Process(self.process.pid)
            for proc in [root, *root.children(recursive=True)]:
                with contextlib.suppress(psutil.Error):
                    t = proc.cpu_times()
                    total += t.user + t.system
        except psutil.Error:
            return 0.0
        return total

    def measured_load(self) -> float:
        now, cpu = time.monotonic(), self._cpu_seconds()
        last, self._cpu_last = self._cpu_last, (now, cpu)
        if last is None or now <= last[0] or not self.alive:
            return 0.0
        cores = max(0.0, cpu - last[1]) / (now - last[0])
        return min(1.0, cores * self.model.slowdown / FULL_LOAD_CORES)

    def tick(self, dt_s: float, load: float | None = None) -> None:
        self.model.advance(dt_s, self.measured_load() if load is None else load)
        self.files.write(self.model)

    def snapshot(self) -> dict[str, Any]:
        s = self.model.state
        return {"name": self.name, "profile": self.profile.key, "alive": self.alive,
                "device_id": self.device_id, "cpu_temp_c": self.model.cpu_temp_c,
                "battery_pct": round(s.battery_pct, 1), "plugged": s.plugged,
                "throttled": self.model.throttled, "cap": round(s.cap, 2), "load": round(s.load, 2),
                "power_w": round(s.power_w, 2), "energy_j": round(s.energy_j, 1),
                "offline": s.faults.offline, "heat_c": s.faults.heat_c}


class PhoneRack:
    """Every phone's physics ticked from one thread, `period_s` apart."""

    def __init__(self, phones: list[SimulatedPhone], period_s: float = 0.5) -> None:
        self.phones = phones
        self.period_s = period_s
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="phone-rack", daemon=True)

    def start(self) -> None:
        for phone in self.phones:
            phone.start()
        self._thread.start()

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(self.period_s):
            now = time.monotonic()
            with self._lock:
                for phone in self.phones:
                    phone.tick(now - last)
            last = now

    def energy_j(self, on_battery: bool | None = None) -> float:
        """What the phones have drawn in all (`on_battery`: only those unplugged, or plugged)."""
        return sum(p.model.state.energy_j for p in self.phones
                   if on_battery is None or p.model.state.plugged != on_battery)

    def by_device(self) -> dict[str, SimulatedPhone]:
        return {p.device_id: p for p in self.phones if p.device_id}

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        for phone in self.phones:  # all at once: each agent may finish a long poll first
            phone.terminate()
        deadline = time.monotonic() + 5.0
        for phone in self.phones:
            phone.stop(timeout_s=deadline - time.monotonic())
