"""What goes wrong during the demo, and when: a phone's cooling fails, a phone dies, a phone
loses its network for a while. Each fault hits the phone holding the most of the job's shards
(among the phones no fault has touched yet), at a fraction of the job's steps."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from phalanx.demo import view
from phalanx.sim.phone import SimulatedPhone


@dataclass
class FaultPlan:
    heat_at: float = 0.2
    kill_at: float = 0.45
    offline_at: float = 0.65
    offline_s: float = 12.0
    heat_c: float = 20.0
    done: set[str] = field(default_factory=set)
    notes: dict[str, str] = field(default_factory=dict)  # device id -> what happened to it
    log: list[str] = field(default_factory=list)
    _restore: list[tuple[float, SimulatedPhone]] = field(default_factory=list)

    def busiest(self, phones: list[SimulatedPhone], job: dict[str, Any]) -> SimulatedPhone | None:
        shards = view.shards_by_device(job)

        def held(p: SimulatedPhone) -> float:
            key = str(p.device_id)
            return float(shards.get(key) or (0.5 if key in shards else 0.0))

        fresh = [p for p in phones if p.alive and p.name not in self.done]
        return max(fresh, key=held) if fresh else None

    def apply(self, phones: list[SimulatedPhone], job: dict[str, Any],
              say: Callable[[str], None]) -> None:
        """Inject what is due at the job's current step; bring a lost network back when due."""
        frac = int(job.get("step") or 0) / max(1, int(job.get("total_steps") or 1))
        step, n = job.get("step"), len(phones)
        limit = ((job.get("spec") or {}).get("placement") or {}).get("max_temp_c", 45)
        if n >= 3 and frac >= self.heat_at:
            self._once("heat", phones, job, say, lambda p: p.heat(self.heat_c),
                       f"cooling failed (+{self.heat_c:g}°C)",
                       f"overheats: its cooling fails at step {step}; it will throttle and pause above "
                       f"{limit:g}°C, and its shards move")
        if n >= 2 and frac >= self.kill_at:
            self._once("kill", phones, job, say, lambda p: p.kill(), "killed",
                       f"dies at step {step} (SIGKILL to its agent)")
        if n >= 5 and frac >= self.offline_at:
            def cut(p: SimulatedPhone) -> None:
                p.set_online(False)
                self._restore.append((time.monotonic() + self.offline_s, p))

            self._once("offline", phones, job, say, cut, "network lost",
                       f"loses its network at step {step} for {self.offline_s:.0f} s")
        for due, phone in list(self._restore):
            if time.monotonic() >= due:
                self._restore.remove((due, phone))
                phone.set_online(True)
                self.notes[str(phone.device_id)] = "network back"
                say(f"{phone.name}: network back")

    def _once(self, kind: str, phones: list[SimulatedPhone], job: dict[str, Any],
              say: Callable[[str], None], act: Callable[[SimulatedPhone], None], note: str,
              what: str) -> None:
        if kind in self.done:
            return
        phone = self.busiest(phones, job)
        if phone is None:
            return
        self.done |= {kind, phone.name}
        act(phone)
        self.notes[str(phone.device_id)] = f"[red]{note}[/red]"
        message = f"{phone.name} ({phone.profile.marketing_name}) {what}"
        self.log.append(message)
        say(f"[bold yellow]fault:[/bold yellow] {message}")
