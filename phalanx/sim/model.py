"""The physics of a simulated phone: heat, frequency caps, battery, and injected faults.

Pure and deterministic: `PhoneModel.advance(dt_s, load)` moves the state forward by `dt_s`
seconds of wall time at CPU load `load` (0..1). `time_scale` speeds the thermal and battery
dynamics up (a demo cannot wait ten minutes for a phone to warm), while the energy estimate is
integrated over real elapsed time at the modelled power.

- Power: `idle_w + (full_w - idle_w) * load * cap**2` (dynamic power falls with frequency and
  voltage), plus charging losses as heat in the battery.
- SoC temperature: first order towards `ambient + r_c_per_w * power` with time constant
  `tau_s`; a cooling fault adds heat to the ambient and doubles the thermal resistance.
- Throttling: above `throttle_c` the governor caps every cluster at
  `1 - throttle_slope * (T - throttle_c)` of its max (never below `min_cap`); `scaling_max_freq`
  and, under load, `scaling_cur_freq` follow the cap.
- Battery: drains at the modelled power while unplugged, charges at `charger_w` (tapering above
  80%) minus the load while plugged; its temperature follows the SoC's slowly.
- Speed: a phone computes at `relative_speed * cap` of the fastest profile, which the simulator
  turns into the agent's slowdown factor `1 / (relative_speed * cap)`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from phalanx.sim.profiles import Profile


@dataclass
class Faults:
    dead: bool = False  # the agent process is killed (the supervisor acts on it)
    offline: bool = False  # the phone's network is gone
    heat_c: float = 0.0  # extra ambient heat (a blocked vent, a hot rack); > 0 also halves cooling
    screen_on: bool = False  # someone is using the phone

    @property
    def overheating(self) -> bool:
        return self.heat_c > 0


@dataclass
class PhoneState:
    soc_c: float
    battery_c: float
    battery_pct: float
    plugged: bool
    cap: float = 1.0  # frequency cap as a fraction of max
    load: float = 0.0
    power_w: float = 0.0
    charge_w: float = 0.0  # into the battery (negative while draining)
    energy_j: float = 0.0
    elapsed_s: float = 0.0
    faults: Faults = field(default_factory=Faults)


class PhoneModel:
    def __init__(self, profile: Profile, *, battery_pct: float = 80.0, plugged: bool = True,
                 ambient_c: float | None = None, time_scale: float = 1.0,
                 seed: int = 0) -> None:
        self.profile = profile
        self.ambient_c = profile.thermal.ambient_c if ambient_c is None else ambient_c
        self.time_scale = time_scale
        rng = random.Random(seed)
        self.jitter = [rng.uniform(-1.5, 0.0) for _ in profile.thermal_zones]
        start = self.ambient_c + profile.thermal.r_c_per_w * profile.idle_w
        self.state = PhoneState(soc_c=start, battery_c=start - 1.0,
                                battery_pct=battery_pct, plugged=plugged)
        self._update_power()

    # -- faults --------------------------------------------------------------------------
    def heat(self, extra_c: float = 20.0) -> None:
        self.state.faults.heat_c = extra_c

    def cool(self) -> None:
        self.state.faults.heat_c = 0.0

    def unplug(self) -> None:
        self.state.plugged = False

    def plug(self) -> None:
        self.state.plugged = True

    # -- physics ---------------------------------------------------------------------------
    @property
    def throttled(self) -> bool:
        return self.state.cap < 0.95

    @property
    def charging(self) -> bool:
        return self.state.plugged and self.state.charge_w > 0

    @property
    def full(self) -> bool:
        return self.state.plugged and self.state.battery_pct >= 100.0

    @property
    def speed(self) -> float:
        """Throughput relative to the fastest profile at full frequency (0 when dead)."""
        return 0.0 if self.state.faults.dead else self.profile.relative_speed * self.state.cap

    @property
    def slowdown(self) -> float:
        """The agent's slowdown factor (docs/contracts.md: PHALANX_AGENT_SLOWDOWN_FILE)."""
        return 1.0 / max(self.profile.relative_speed * self.state.cap, 1e-3)

    @property
    def surroundings_c(self) -> float:
        """The air around the phone: the room plus any heat a fault adds."""
        return self.ambient_c + self.state.faults.heat_c

    def soc_target_c(self) -> float:
        t = self.profile.thermal
        r = t.r_c_per_w * (2.0 if self.state.faults.overheating else 1.0)
        return self.ambient_c + self.state.faults.heat_c + r * self.state.power_w

    def _cap_for(self, soc_c: float) -> float:
        t = self.profile.thermal
        over = soc_c - t.throttle_c
        return 1.0 if over <= 0 else max(t.min_cap, 1.0 - t.throttle_slope * over)

    def _update_power(self) -> None:
        s, p = self.state, self.profile
        if s.faults.dead:  # the phone is gone: it draws nothing we pay for
            s.power_w = 0.0
        else:
            s.power_w = p.idle_w + (p.full_w - p.idle_w) * s.load * s.cap**2
        if not s.plugged:
            s.charge_w = -s.power_w
        elif s.battery_pct >= 100.0:
            s.charge_w = 0.0
        else:
            taper = 1.0 if s.battery_pct < 80 else max(0.1, (100.0 - s.battery_pct) / 20.0)
            s.charge_w = p.charger_w * taper - s.power_w

    def advance(self, dt_s: float, load: float) -> None:
        """Move the phone forward by `dt_s` seconds at CPU load `load`."""
        if dt_s <= 0:
            return
        s, t = self.state, self.profile.thermal
        s.load = min(1.0, max(0.0, load))
        s.cap = self._cap_for(s.soc_c)
        self._update_power()
        sim_dt = dt_s * self.time_scale
        s.soc_c += (self.soc_target_c() - s.soc_c) * min(1.0, sim_dt / t.tau_s)
        charge_heat = 3.0 if self.charging else 0.0
        around = self.surroundings_c
        battery_target = around + 0.55 * (s.soc_c - around) + charge_heat
        s.battery_c += (battery_target - s.battery_c) * min(1.0, sim_dt / t.battery_tau_s)
        pct = s.battery_pct + 100.0 * s.charge_w * sim_dt / (self.profile.capacity_wh * 3600.0)
        s.battery_pct = min(100.0, max(0.0, pct))
        s.cap = self._cap_for(s.soc_c)
        self._update_power()
        s.energy_j += s.power_w * dt_s
        s.elapsed_s += dt_s

    # -- what the kernel shows ------------------------------------------------------------
    def core_freqs_khz(self) -> list[tuple[int, int, int]]:
        """Per core: (cpuinfo_max_freq, scaling_max_freq, scaling_cur_freq) in kHz."""
        out = []
        busy = 0.0 if self.state.faults.dead else self.state.load
        for cluster in self.profile.core_clusters():
            cap_khz = max(cluster.min_khz, int(cluster.max_khz * self.state.cap))
            want = cluster.min_khz + (cluster.max_khz - cluster.min_khz) * (0.15 + 0.85 * busy)
            cur = int(min(cap_khz, max(cluster.min_khz, want)))
            out.append((cluster.max_khz, cap_khz, cur - cur % 100))
        return out

    def zone_temps_c(self) -> list[tuple[str, float]]:
        """Each thermal zone: CPU zones at or just below the SoC, skin and PA cooler."""
        s = self.state
        out = []
        for i, (name, jitter) in enumerate(zip(self.profile.thermal_zones, self.jitter)):
            low = name.lower()
            if "skin" in low:
                temp = self.surroundings_c + 0.45 * (s.soc_c - self.surroundings_c)
            elif "pa_" in low or "gpu" in low or "g3d" in low or "isp" in low:
                temp = s.soc_c - 3.0 + jitter
            else:
                temp = s.soc_c + (0.0 if i == 0 else jitter)
            out.append((name, round(temp, 1)))
        return out

    @property
    def cpu_temp_c(self) -> float:
        return round(self.state.soc_c, 1)

    def battery_voltage_mv(self) -> int:
        base = 3500.0 + 700.0 * self.state.battery_pct / 100.0
        return int(base + (60.0 if self.charging else 0.0))

    def battery_current_ua(self) -> int:
        """Into the battery, positive while charging (Termux:API's convention)."""
        volts = self.battery_voltage_mv() / 1000.0
        return int(1e6 * self.state.charge_w / volts)

    def battery_status(self) -> str:
        if self.full:
            return "FULL"
        if self.charging:
            return "CHARGING"
        return "DISCHARGING" if not self.state.plugged else "NOT_CHARGING"

    def battery_health(self) -> str:
        return "OVERHEAT" if self.state.battery_c > 45.0 else "GOOD"
