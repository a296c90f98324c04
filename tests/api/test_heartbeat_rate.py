"""The heartbeat rate at its documented defaults (docs/deploy.md, PHALANX_HEARTBEAT_MAX_PER_MINUTE:
"unset: 4x what the interval asks (24 a minute at 10 s)"; PHALANX_HEARTBEAT_BURST: 10 at once):
a phone sends its burst, then one more each 2.5 s; the 11th at once, or one 2.499 s later, waits.
The bucket's clock is the test's (api.limits.DeviceRate takes it)."""

from __future__ import annotations

import pytest

from api.limits import DeviceRate
from domain.settings import Settings

DEFAULTS = Settings.model_construct()  # the defaults, without this process's environment


def test_the_default_rate_is_4x_what_the_interval_asks() -> None:
    assert DEFAULTS.heartbeat_rate_per_minute == 24  # 4 x 60 / 10 s
    assert Settings.model_construct(heartbeat_interval_s=5.0).heartbeat_rate_per_minute == 48
    assert Settings.model_construct(heartbeat_interval_s=5.0,
                                    heartbeat_max_per_minute=7.5).heartbeat_rate_per_minute == 7.5


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_phone_sends_its_burst_then_one_each_2_5_s() -> None:
    clock = Clock()
    rate = DeviceRate(DEFAULTS.heartbeat_rate_per_minute, DEFAULTS.heartbeat_burst, clock)
    for _ in range(10):
        assert rate.wait_s("phone") == 0
        rate.spend("phone")
    assert rate.wait_s("phone") == pytest.approx(2.5)  # the 11th at once waits
    assert rate.wait_s("other") == 0  # one phone's rate, not the fleet's
    clock.now = 2.499
    assert rate.wait_s("phone") == pytest.approx(0.001)
    clock.now = 2.5
    assert rate.wait_s("phone") == 0
    rate.spend("phone")
    assert rate.wait_s("phone") == pytest.approx(2.5)


def test_a_rested_phone_gets_its_burst_back_and_no_more() -> None:
    clock = Clock()
    rate = DeviceRate(DEFAULTS.heartbeat_rate_per_minute, DEFAULTS.heartbeat_burst, clock)
    rate.spend("phone")
    clock.now = -3600.0  # a wall clock stepped back costs the phone nothing
    assert rate.wait_s("phone") == 0
    clock.now = 3600.0
    for _ in range(10):
        assert rate.wait_s("phone") == 0
        rate.spend("phone")
    assert rate.wait_s("phone") > 0
