"""The fleet's last hour (pictures.history): buckets past either end, the hottest temperature,
a phone's part of a job's samples by the shards it held."""

from __future__ import annotations

from pictures.history import Buckets, device_rates, telemetry_history

HOUR = Buckets(count=60, width_s=60.0)


def test_the_hottest_temperature_and_rows_past_the_ends_join_the_end_buckets() -> None:
    rows = [("a", 0, 80.0, 30.0, 41.0), ("a", -1, 90.0, None, 39.0), ("a", 60, 50.0, 35.0, None),
            ("a", 59, 60.0, None, None), ("b", 10, None, None, None)]
    history = telemetry_history(rows, HOUR)
    assert history["a"].battery == [(-3570.0, 85.0), (-30.0, 55.0)]
    assert history["a"].temp == [(-3570.0, 40.0), (-30.0, 35.0)]
    assert history["b"].battery == history["b"].temp == []


def test_a_phone_trains_its_share_of_the_shards_and_zero_once_it_holds_none() -> None:
    placements = {"j": [{"data": {"step": 0, "counts": {"a": 3, "b": 1}}},
                        {"data": {"step": 100, "counts": {"b": 2}}},
                        {"reason": "NodeNotReady", "data": {}}]}
    # (job, bucket, samples, first step, last step): 600 samples a minute is 10 a second
    samples = [("j", 57, 600, 80, 89), ("j", 58, 600, 95, 104), ("j", 59, 600, 110, 119),
               ("other", 59, 600, 0, 9)]  # no placement known: nobody's
    rates = device_rates(samples, placements, HOUR)
    assert rates == {"a": [(-150.0, 7.5), (-90.0, 7.5), (-30.0, 0.0)],
                     "b": [(-150.0, 2.5), (-90.0, 2.5), (-30.0, 10.0)]}
