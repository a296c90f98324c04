"""The shard sampler: disjoint shards, each sample once per epoch, a pure function."""

from __future__ import annotations

import numpy as np
import pytest

from engine.sampler import microbatch, shard_indices, steps_per_epoch, total_steps


def test_shards_are_disjoint_cover_the_data_and_differ_in_size_by_at_most_one():
    parts = shard_indices(1438, 16, seed=0)
    assert len(parts) == 16
    joined = np.concatenate(parts)
    assert sorted(joined.tolist()) == list(range(1438))
    assert max(map(len, parts)) - min(map(len, parts)) <= 1


def test_shard_split_follows_the_seed():
    a, b, c = (shard_indices(100, 4, s) for s in (0, 0, 1))
    assert all(np.array_equal(p, q) for p, q in zip(a, b))
    assert not all(np.array_equal(p, q) for p, q in zip(a, c))


def test_every_sample_is_used_exactly_once_per_epoch_when_shards_divide_evenly():
    n, shards, batch = 96, 4, 8  # 24 per shard, m = 2, 12 steps per epoch
    spe = steps_per_epoch(n, shards, batch)
    assert spe == 12
    parts = shard_indices(n, shards, 5)
    for epoch in range(2):
        used = []
        for t in range(epoch * spe, (epoch + 1) * spe):
            for k, part in enumerate(parts):
                used += part[microbatch(len(part), 2, 5, t, k, spe)].tolist()
        assert sorted(used) == list(range(n))


def test_drop_last_uses_each_sample_at_most_once_and_reshuffles_next_epoch():
    parts = shard_indices(1438, 16, 0)  # shards of 89 and 90, m = 16: 5 steps, rest dropped
    spe = steps_per_epoch(1438, 16, 256)
    assert spe == 5 and total_steps(1438, 16, 256, 20) == 100
    k, part = 3, parts[3]
    epoch0 = np.concatenate([microbatch(len(part), 16, 0, t, k, spe) for t in range(5)])
    epoch1 = np.concatenate([microbatch(len(part), 16, 0, t, k, spe) for t in range(5, 10)])
    assert len(set(epoch0.tolist())) == 80
    assert set(epoch0.tolist()) != set(epoch1.tolist())


def test_microbatch_is_a_pure_function_of_seed_step_and_shard():
    base = microbatch(90, 16, 0, 7, 3, 5)
    assert np.array_equal(base, microbatch(90, 16, 0, 7, 3, 5))
    for args in ((90, 16, 1, 7, 3, 5), (90, 16, 0, 8, 3, 5), (90, 16, 0, 7, 4, 5)):
        assert not np.array_equal(base, microbatch(*args))


@pytest.mark.parametrize(("n", "shards", "batch", "needle"), [
    (100, 4, 10, "divisible"),
    (10, 4, 16, "fewer than the 4 per-shard batch"),
])
def test_impossible_batch_shapes_are_refused_with_the_reason(n, shards, batch, needle):
    with pytest.raises(ValueError, match=needle):
        steps_per_epoch(n, shards, batch)
