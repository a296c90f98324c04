"""The scheduler trusts no stored value's type and no float it is handed (issue 42, items 1
and 2). `device_view` turns any JSON in a device's columns (capabilities, profiles, telemetry,
spec, labels: rows written before the schemas said what they hold) into a view whose every
part is of its type, a malformed part counting as absent; the shard split gives whole counts
that add up for any speeds at all: NaN, infinities, 1e308, subnormals, negatives."""

from __future__ import annotations

import math
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from domain.store.models import Device
from scheduler.policy.placement import place_gang
from scheduler.policy.scores import device_speed
from scheduler.policy.shards import balance_shards, proportional_counts
from scheduler.policy.types import MAX_SPEED, DeviceView, PlacementRequest
from scheduler.store_ops import device_view

FAST = settings(max_examples=300, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])

ANY_FLOAT = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from(
    [1e308, -1e308, 5e-324, 0.0, -0.0, MAX_SPEED, math.nan, math.inf, -math.inf])
SPEEDS = st.dictionaries(st.text("abcdefgh", min_size=1, max_size=3), ANY_FLOAT,
                         min_size=1, max_size=10)
LEAF = (st.none() | st.booleans() | st.integers(-(2**80), 2**80) | ANY_FLOAT
        | st.text(max_size=5) | st.sampled_from(["mlp", "numpy", "portable", "40", "nan"]))
ANY_JSON = st.recursive(LEAF, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.sampled_from(["mlp", "archs", "x", "samples_per_s", "cpu_temp_c"]) | st.text(max_size=4),
    inner, max_size=4), max_leaves=12)


def keys_of(*names: str) -> st.SearchStrategy[dict[str, Any]]:
    """A JSON object with any of these keys, each holding any JSON."""
    return st.fixed_dictionaries({}, optional={name: ANY_JSON for name in names})


COLUMNS = {
    "capabilities": keys_of("archs", "backends", "features", "compute_class") | ANY_JSON,
    "profiles": st.dictionaries(st.sampled_from(["mlp", "cnn"]) | st.text(max_size=3),
                                keys_of("samples_per_s", "threads") | ANY_JSON, max_size=3)
    | ANY_JSON,
    "latest_telemetry": keys_of("battery_pct", "charging", "cpu_temp_c", "battery_temp_c")
    | ANY_JSON,
    "spec": keys_of("cpu_cores", "ram_mb") | ANY_JSON,
    "labels": ANY_JSON,
}


def _finite_or_none(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isfinite(value))


@FAST
@given(st.fixed_dictionaries({}, optional=COLUMNS), st.integers(1, 64))
def test_any_stored_json_gives_a_typed_view_and_a_placement(columns: dict[str, Any],
                                                            shards: int) -> None:
    device = Device(id="dev-x", name="x", state="Ready", cordoned=False, draining=False,
                    upgrade_to=None, **columns)
    view = device_view(device, None)
    assert all(_finite_or_none(v) for v in (view.battery_pct, view.temp_c, view.ram_mb))
    assert view.charging in (None, True, False)
    assert isinstance(view.cpu_cores, int) and 1 <= view.cpu_cores <= 1024
    for names in (view.archs, view.backends, view.features):
        assert names is None or all(isinstance(n, str) for n in names)
    assert all(isinstance(k, str) and 0 < v <= MAX_SPEED for k, v in view.speeds.items())
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in view.labels.items())
    assert view.compute_class is None or len(view.compute_class) == 16
    # and placement takes it as it is, beside an honest phone
    honest = DeviceView("dev-a", speeds={"mlp": 100.0})
    req = PlacementRequest(job_id="j", arch="mlp", shards=shards, min_devices=1,
                           max_devices=2, exactness="portable")
    placed = place_gang(req, [honest, view])
    if placed.admitted:
        assert sorted(placed.shards) == list(range(shards))


@FAST
@given(SPEEDS, st.integers(0, 10_000))
def test_the_split_is_whole_and_adds_up_for_any_speeds(speeds: dict[str, float],
                                                       total: int) -> None:
    counts = proportional_counts(total, speeds)
    assert set(counts) == set(speeds)
    assert all(isinstance(n, int) and n >= 0 for n in counts.values())
    assert sum(counts.values()) == total
    if total >= len(speeds):  # nobody holds a phone with nothing to do
        assert min(counts.values()) >= 1
    usable = {d for d, s in speeds.items() if math.isfinite(s) and s > 0}
    if usable and total >= len(speeds):  # what is no speed never outweighs a real one
        worst = min(counts[d] for d in usable)
        assert all(counts[d] <= max(1, worst) for d in set(speeds) - usable)


@FAST
@given(SPEEDS, st.integers(1, 512), st.dictionaries(st.integers(0, 600),
                                                    st.text("abcdefghz", min_size=1,
                                                            max_size=3)))
def test_every_shard_goes_to_one_of_the_devices_for_any_speeds(
        speeds: dict[str, float], shards: int, current: dict[int, str]) -> None:
    placed = balance_shards(shards, speeds, current)
    assert sorted(placed) == list(range(shards))
    assert set(placed.values()) <= set(speeds)


@FAST
@given(ANY_FLOAT, st.integers(-5, 10**6))
def test_a_devices_speed_is_always_a_finite_positive_number(speed: float, cores: int) -> None:
    view = DeviceView("d", speeds={"mlp": speed}, cpu_cores=cores)
    assert 0 < device_speed(view, "mlp") < math.inf


def test_the_issues_speeds() -> None:
    """1e308 twice summed to infinity ("cannot convert float NaN to integer"); NaN won the
    phone 7 of 8 shards; Infinity."""
    assert proportional_counts(8, {"a": 1e308, "b": 1e308}) == {"a": 4, "b": 4}
    assert proportional_counts(8, {"a": math.inf, "b": 100.0, "c": 100.0})["a"] == 1
    assert proportional_counts(8, {"a": math.nan, "b": 100.0, "c": 100.0})["a"] == 1
    assert proportional_counts(8, {"a": math.nan, "b": math.nan}) == {"a": 4, "b": 4}
