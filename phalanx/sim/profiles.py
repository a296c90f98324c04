"""Device profiles of simulated phones, loaded from `profiles.json` beside this file."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

PROFILES_FILE = Path(__file__).with_name("profiles.json")


@dataclass(frozen=True)
class Cluster:
    name: str
    cores: int
    min_khz: int
    max_khz: int


@dataclass(frozen=True)
class Thermal:
    ambient_c: float
    r_c_per_w: float  # steady-state rise per watt
    tau_s: float  # time constant of the SoC
    battery_tau_s: float  # the battery follows more slowly
    throttle_c: float  # the governor starts capping frequency here
    throttle_slope: float  # cap lost per degree above throttle_c
    min_cap: float  # the cap never goes below this fraction of max


@dataclass(frozen=True)
class Profile:
    key: str
    model: str
    marketing_name: str
    soc: str
    ram_kb: int
    clusters: tuple[Cluster, ...]
    thermal_zones: tuple[str, ...]
    capacity_mah: float
    charger_w: float
    sysfs_current_sign: int  # vendors disagree on the sign of current_now
    idle_w: float
    full_w: float
    thermal: Thermal
    relative_speed: float

    @property
    def n_cores(self) -> int:
        return sum(c.cores for c in self.clusters)

    @property
    def capacity_wh(self) -> float:
        return self.capacity_mah * 3.85 / 1000.0  # nominal Li-ion cell voltage

    def core_clusters(self) -> list[Cluster]:
        """The cluster of each core, core 0 first (little cores come first, as on Android)."""
        return [c for c in self.clusters for _ in range(c.cores)]

    def hardware_spec(self) -> dict[str, Any]:
        """What registration reports as the device's `spec` (DESIGN.md)."""
        first = 0
        clusters = []
        for c in self.clusters:
            clusters.append({"name": c.name, "cores": list(range(first, first + c.cores)),
                             "max_mhz": c.max_khz / 1000.0})
            first += c.cores
        return {"model": self.model, "soc": self.soc, "cpu_cores": self.n_cores,
                "ram_mb": self.ram_kb // 1024, "clusters": clusters, "simulated": True}


def _profile(key: str, raw: dict[str, Any]) -> Profile:
    bat, power = raw["battery"], raw["power"]
    return Profile(
        key=key, model=raw["model"], marketing_name=raw["marketing_name"], soc=raw["soc"],
        ram_kb=int(raw["ram_kb"]),
        clusters=tuple(Cluster(**c) for c in raw["clusters"]),
        thermal_zones=tuple(raw["thermal_zones"]),
        capacity_mah=float(bat["capacity_mah"]), charger_w=float(bat["charger_w"]),
        sysfs_current_sign=int(bat.get("sysfs_current_sign", 1)),
        idle_w=float(power["idle_w"]), full_w=float(power["full_w"]),
        thermal=Thermal(**raw["thermal"]), relative_speed=float(raw["relative_speed"]),
    )


@lru_cache(maxsize=4)
def load_profiles(path: Path = PROFILES_FILE) -> dict[str, Profile]:
    data = json.loads(path.read_text())
    return {key: _profile(key, raw) for key, raw in data["profiles"].items()}


def get_profile(key: str) -> Profile:
    profiles = load_profiles()
    if key not in profiles:
        raise KeyError(f"unknown phone profile {key!r}; known: {', '.join(sorted(profiles))}")
    return profiles[key]


def fleet_mix(n: int) -> list[Profile]:
    """A rack's worth of phones: mostly S10+ of both variants, some mid-range, a few old ones."""
    order = ["galaxy-s10plus-sd855", "galaxy-s10plus-exynos9820", "galaxy-a52-sd720g",
             "galaxy-s10plus-sd855", "nexus-5x-sd808", "galaxy-s10plus-exynos9820"]
    return [get_profile(order[i % len(order)]) for i in range(n)]
