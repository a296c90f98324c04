"""The report's pure parts: who held how many shards when, and where each event sits."""

from __future__ import annotations

from pictures.report import event_steps, holdings, line_chart


def test_holdings_follow_the_counts_the_placement_events_carry():
    events = [
        (0.0, {"reason": "Scheduled", "data": {"step": 0, "counts": {"a": 2, "b": 2}}}),
        (10.0, {"reason": "ShardsMoved", "data": {"step": 10, "counts": {"a": 4}}}),
        (15.0, {"reason": "ShardsMoved", "data": {"step": 15, "counts": {"a": 2, "c": 2}}}),
        (12.0, {"reason": "NodeNotReady", "device_id": "b", "data": {}}),
    ]
    lanes = holdings(events, end=20)
    assert lanes == {"a": [(0.0, 10.0, 2), (10.0, 15.0, 4), (15.0, 20, 2)],
                     "b": [(0.0, 10.0, 2)], "c": [(15.0, 20, 2)]}


def test_an_event_without_a_step_sits_at_the_first_step_recorded_after_it():
    metrics = [{"step": s, "ts": f"2026-12-05T10:00:{s:02d}Z"} for s in range(5)]
    events = [{"reason": "Paused", "ts": "2026-12-05T10:00:02.5Z"},
              {"reason": "ShardsMoved", "data": {"step": 1}}]
    assert [step for step, _ in event_steps(events, metrics)] == [3.0, 1.0]


def test_a_chart_draws_one_point_per_value_and_says_when_it_has_none():
    chart = line_chart("Loss", {"train": [(0, 2.0), (1, 1.0), (2, 0.5)], "validation": []})
    assert 'data-series="train" data-points="3"' in chart and "validation" not in chart
    assert "no data" in line_chart("Energy", {"joules": []})
