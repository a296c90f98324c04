"""The eviction rate limit's documented numbers, pinned at their boundaries (issue 44 item 2):
docs/scheduler.md says "when more than 55% of a fleet of 3 or more is NotReady, lease-loss
evictions are limited to 1 per 60 s". Just inside passes, at or just past is refused, and the
sentence is checked against the defaults it quotes."""

from __future__ import annotations

import re

from scheduler.policy.eviction import EvictionLimits, allowed_evictions, is_disrupted, prune
from tests.support.server import REPO_ROOT

LIMITS = EvictionLimits()


def test_the_documented_sentence_quotes_the_defaults() -> None:
    doc = (REPO_ROOT / "docs" / "scheduler.md").read_text()
    said = re.search(r"more than (\d+)% of\s+a fleet of (\d+) or more is NotReady, lease-loss\s+"
                     r"evictions are limited to (\d+) per (\d+) s", doc)
    assert said, "docs/scheduler.md no longer states the eviction rate limit"
    percent, fleet, per, window = (int(v) for v in said.groups())
    assert percent / 100 == LIMITS.disrupted_fraction and fleet == LIMITS.min_fleet
    assert per == LIMITS.disrupted_per_window and window == LIMITS.window_s


def test_disrupted_is_strictly_more_than_the_fraction() -> None:
    assert not is_disrupted(100, 55, LIMITS)  # exactly 55%: still healthy
    assert is_disrupted(100, 56, LIMITS)
    assert not is_disrupted(20, 11, LIMITS)  # 55% again, another size
    assert is_disrupted(20, 12, LIMITS)
    assert not is_disrupted(100, 51, LIMITS)  # a 0.50 threshold would call this disrupted


def test_a_fleet_below_the_minimum_is_never_disrupted() -> None:
    assert not is_disrupted(2, 2, LIMITS)  # every phone gone, but two phones say nothing
    assert is_disrupted(3, 2, LIMITS)  # the smallest fleet a fraction speaks for
    assert not is_disrupted(0, 0, LIMITS)


def test_a_disrupted_fleet_evicts_one_per_window_and_the_window_is_half_open() -> None:
    now = 1000.0
    window = LIMITS.window_s
    assert allowed_evictions(100, 60, [], now) == LIMITS.disrupted_per_window == 1
    assert allowed_evictions(100, 60, [now - window + 0.001], now) == 0  # inside the window
    assert allowed_evictions(100, 60, [now - window], now) == 1  # exactly 60 s ago: out
    assert prune([now - window, now - window + 0.001], now) == [now - window + 0.001]
    # a healthy fleet: effectively unlimited
    assert allowed_evictions(100, 55, [now] * 10, now) == LIMITS.per_window - 10
