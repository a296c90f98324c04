"""The rollout rules (scheduler.policy.upgrades): a few idle phones at a time, never one in a
job, a failed version never asked again, upgrades closed when done, late or called off."""

from __future__ import annotations

import datetime as dt

from scheduler.policy.upgrades import AgentView, Rollout, plan_upgrades

NOW = dt.datetime(2026, 12, 5, 12, 0, tzinfo=dt.timezone.utc)
ROLLOUT = Rollout("0.2.0", "ab" * 32, max_parallel=2)


def phone(i: int, **kw: object) -> AgentView:
    return AgentView(**{"id": f"dev-{i}", "state": "Ready", "agent_version": "0.1.0", **kw})


def test_at_most_max_parallel_idle_outdated_phones_start_in_order() -> None:
    fleet = [phone(0, agent_version="0.2.0"), phone(1, holds_shards=True),
             phone(2, pause_reason="thermal"), phone(3, state="NotReady"),
             phone(4, state="Cordoned"), phone(5, agent_version=None),
             phone(9, can_upgrade=False),  # an older agent, or one not started by launch.sh
             phone(6), phone(7), phone(8)]
    assert plan_upgrades(fleet, ROLLOUT, NOW, 600).start == ["dev-6", "dev-7"]


def test_phones_already_upgrading_count_against_the_limit() -> None:
    started = NOW - dt.timedelta(seconds=30)
    fleet = [phone(0, upgrading_to="0.2.0", upgrade_started=started), phone(1), phone(2)]
    plan = plan_upgrades(fleet, ROLLOUT, NOW, 600)
    assert plan.start == ["dev-1"] and not plan.done and not plan.timed_out


def test_a_phone_back_with_the_version_is_done_and_frees_its_place() -> None:
    started = NOW - dt.timedelta(seconds=30)
    fleet = [phone(0, agent_version="0.2.0", upgrading_to="0.2.0", upgrade_started=started),
             phone(1, upgrading_to="0.2.0", upgrade_started=started), phone(2), phone(3)]
    plan = plan_upgrades(fleet, ROLLOUT, NOW, 600)
    assert plan.done == ["dev-0"] and plan.start == ["dev-2"]


def test_a_late_phone_times_out_and_a_failed_version_is_not_asked_again() -> None:
    late = NOW - dt.timedelta(seconds=601)
    fleet = [phone(0, upgrading_to="0.2.0", upgrade_started=late),
             phone(1, upgrade_failed="0.2.0"), phone(2, upgrade_failed="0.1.5")]
    plan = plan_upgrades(fleet, ROLLOUT, NOW, 600)
    assert plan.timed_out == ["dev-0"]
    assert plan.start == ["dev-2"]  # it failed another version: this one it tries


def test_no_rollout_starts_nothing_and_calls_off_what_was_asked() -> None:
    fleet = [phone(0, upgrading_to="0.2.0", upgrade_started=NOW), phone(1)]
    plan = plan_upgrades(fleet, None, NOW, 600)
    assert plan.cancelled == ["dev-0"] and not plan.start
    other = plan_upgrades(fleet, Rollout("0.3.0", "cd" * 32, 5), NOW, 600)
    assert other.cancelled == ["dev-0"] and other.start == ["dev-1"]
