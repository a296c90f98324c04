"""The simulated phone's physics: what a person watching the fleet table would notice."""

from __future__ import annotations

import pytest

from phalanx.sim.model import PhoneModel
from phalanx.sim.profiles import fleet_mix, get_profile, load_profiles

SECOND = 1.0


def run(model: PhoneModel, seconds: float, load: float) -> None:
    for _ in range(int(seconds / SECOND)):
        model.advance(SECOND, load)


def test_the_four_profiles_of_the_issue_are_there_with_their_clusters() -> None:
    profiles = load_profiles()
    sd855 = profiles["galaxy-s10plus-sd855"]
    exynos = profiles["galaxy-s10plus-exynos9820"]
    assert [c.cores for c in sd855.clusters] == [4, 3, 1]
    assert [c.cores for c in exynos.clusters] == [4, 2, 2]
    assert sd855.clusters[-1].max_khz == 2841600
    assert len(profiles) >= 4
    speeds = sorted(p.relative_speed for p in profiles.values())
    assert speeds[0] < 0.5 < speeds[-1] == 1.0  # an old phone, a flagship


def test_unknown_profile_names_the_known_ones() -> None:
    with pytest.raises(KeyError, match="galaxy-s10plus-sd855"):
        get_profile("iphone")


@pytest.mark.parametrize("profile", list(load_profiles()))
def test_a_cooled_phone_under_full_load_warms_but_stays_below_its_throttle_point(profile: str) -> None:
    model = PhoneModel(get_profile(profile), time_scale=10)
    idle = model.cpu_temp_c
    run(model, 120, load=1.0)
    assert model.cpu_temp_c > idle + 5
    assert model.cpu_temp_c < model.profile.thermal.throttle_c
    assert not model.throttled
    assert model.slowdown == pytest.approx(1.0 / model.profile.relative_speed)


def test_temperature_falls_again_when_the_load_stops() -> None:
    model = PhoneModel(get_profile("galaxy-s10plus-sd855"), time_scale=10)
    run(model, 120, load=1.0)
    hot = model.cpu_temp_c
    run(model, 120, load=0.0)
    assert model.cpu_temp_c < hot - 5


def test_a_heated_phone_throttles_its_frequency_drops_and_it_slows_down() -> None:
    model = PhoneModel(get_profile("galaxy-s10plus-sd855"), time_scale=10)
    run(model, 60, load=1.0)
    cur_before = [cur for _, _, cur in model.core_freqs_khz()]
    slow_before = model.slowdown
    model.heat(20.0)
    run(model, 120, load=1.0)
    assert model.cpu_temp_c > 45
    assert model.throttled
    for (max_khz, cap_khz, cur_khz), before in zip(model.core_freqs_khz(), cur_before):
        assert cap_khz < 0.95 * max_khz
        assert cur_khz < before
    assert model.slowdown > 1.3 * slow_before
    model.cool()
    run(model, 240, load=0.0)
    assert not model.throttled


def test_unplugged_phone_drains_and_plugged_phone_charges() -> None:
    model = PhoneModel(get_profile("galaxy-a52-sd720g"), battery_pct=50, plugged=False,
                       time_scale=60)
    run(model, 60, load=1.0)
    assert model.state.battery_pct < 50
    assert model.battery_status() == "DISCHARGING"
    assert model.battery_current_ua() < 0
    low = model.state.battery_pct
    model.plug()
    run(model, 60, load=1.0)
    assert model.state.battery_pct > low
    assert model.battery_status() == "CHARGING"
    assert model.battery_current_ua() > 0


def test_energy_is_integrated_over_real_time_at_the_modelled_power() -> None:
    p = get_profile("nexus-5x-sd808")
    model = PhoneModel(p, time_scale=50)
    run(model, 10, load=0.0)
    assert model.state.energy_j == pytest.approx(10 * p.idle_w, rel=1e-6)


def test_fleet_mix_has_both_s10_variants_a_mid_range_and_an_old_phone() -> None:
    keys = {p.key for p in fleet_mix(6)}
    assert keys == {"galaxy-s10plus-sd855", "galaxy-s10plus-exynos9820", "galaxy-a52-sd720g",
                    "nexus-5x-sd808"}


def test_a_heated_phone_also_heats_its_battery_past_the_limit_an_unrooted_agent_sees() -> None:
    model = PhoneModel(get_profile("galaxy-s10plus-sd855"), time_scale=10)
    run(model, 60, load=1.0)
    assert model.state.battery_c < 45
    model.heat(20.0)
    run(model, 300, load=0.2)
    assert model.state.battery_c > 45
    assert model.battery_health() == "OVERHEAT"
