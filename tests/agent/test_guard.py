"""Phone first: when the guard pauses and when it lets training resume (table-driven)."""

from __future__ import annotations

import pytest

from agent.runtime.guard import Limits, PhoneGuard


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


LIMITS = Limits(max_temp_c=45, min_battery=20, shared_mode=False)
SHARED = Limits(max_temp_c=45, min_battery=20, shared_mode=True)


@pytest.mark.parametrize(
    ("story", "readings", "reasons"),
    [
        ("a cool phone trains", [{"cpu_temp_c": 40}], [None]),
        ("a phone over the limit pauses", [{"cpu_temp_c": 46}], ["thermal"]),
        ("cooling just under the limit is not enough",
         [{"cpu_temp_c": 46}, {"cpu_temp_c": 44.5}, {"cpu_temp_c": 42.5}], ["thermal"] * 3),
        ("cooling by the hysteresis resumes",
         [{"cpu_temp_c": 46}, {"cpu_temp_c": 42}], ["thermal", None]),
        ("an unrooted phone is judged by its battery temperature",
         [{"battery_temp_c": 46.8}], ["thermal"]),
        ("a missing sensor keeps the last verdict", [{"cpu_temp_c": 46}, {}], ["thermal"] * 2),
        ("a low battery while discharging pauses",
         [{"battery_pct": 15, "charging": False}], ["battery"]),
        ("a low battery while charging trains", [{"battery_pct": 15, "charging": True}], [None]),
        ("battery resumes only past the hysteresis",
         [{"battery_pct": 19, "charging": False}, {"battery_pct": 22, "charging": False},
          {"battery_pct": 25, "charging": False}], ["battery", "battery", None]),
        ("plugging in resumes at once",
         [{"battery_pct": 19, "charging": False}, {"battery_pct": 19, "charging": True}],
         ["battery", None]),
        ("heat is reported before the battery",
         [{"cpu_temp_c": 50, "battery_pct": 10, "charging": False}], ["thermal"]),
        ("a busy user does not matter outside shared mode", [{"busy": True}], [None]),
    ],
)
def test_guard(story: str, readings: list[dict], reasons: list[str | None]) -> None:
    guard = PhoneGuard(clock=Clock())
    got = [getattr(guard.check(r, LIMITS), "reason", None) for r in readings]
    assert got == reasons, story


def test_shared_mode_waits_for_the_user_to_be_quiet_for_a_while() -> None:
    clock = Clock()
    guard = PhoneGuard(busy_quiet_s=30, clock=clock)
    pause = guard.check({"busy": True, "screen_on": True}, SHARED)
    assert pause is not None and pause.reason == "busy" and "screen on" in pause.detail
    clock.now = 10
    assert guard.check({"busy": False}, SHARED).reason == "busy"  # 10 s quiet: not yet
    clock.now = 31
    assert guard.check({"busy": False}, SHARED) is None


def test_the_job_spec_sets_the_limits() -> None:
    spec = {"placement": {"max_temp_c": 39, "min_battery": 50, "shared_mode": True}}
    assert Limits.from_job_spec(spec) == Limits(39, 50, True)
    assert Limits.from_job_spec({}) == Limits(45, 20, False)
    assert Limits.from_job_spec({}, shared_default=True).shared_mode is True
