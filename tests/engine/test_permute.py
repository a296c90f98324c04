"""The sampler's permutation, computed one index at a time (engine.sampler.permute): a
permutation of [0, n) for every n, a pure function of its integers written with integer
arithmetic only (checked against a plain-Python reading of docs/engine.md's definition), and a
shard's chunk found with memory in proportion to the chunk, never to n."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from engine.sampler import (
    FEISTEL_ROUNDS,
    SHARD_TAG,
    permute,
    shard_bounds,
    shard_indices,
    shard_length,
    shard_samples,
)

MASK = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15


def mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def reference(n: int, words: tuple[int, ...], i: int) -> int:
    """docs/engine.md, "The sampler (definition)", in Python integers (no numpy)."""
    z = len(words)
    for w in words:
        z = mix((z + GOLDEN + (w & MASK)) & MASK)
    keys = []
    for _ in range(FEISTEL_ROUNDS):
        z = (z + GOLDEN) & MASK
        keys.append(mix(z))
    b = max(2, (n - 1).bit_length())
    a, c = (b + 1) // 2, b // 2

    def encrypt(v: int) -> int:
        for key in keys:
            hi, lo = v >> c, v & ((1 << c) - 1)
            v = (lo << a) | (hi ^ (mix(lo ^ key) >> (64 - a)))
        return v

    v = encrypt(i)
    while v >= n:
        v = encrypt(v)
    return v


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 7, 8, 9, 31, 100, 1000, 4097, 65_536, 65_537,
                               200_003])
def test_every_n_gives_a_permutation(n):
    out = permute(n, (3, SHARD_TAG), np.arange(n))
    assert out.dtype == np.int64
    assert np.array_equal(np.sort(out), np.arange(n))


@pytest.mark.parametrize("n", [1, 2, 5, 97, 1000, 123_457, 2**40 + 3])
def test_it_is_the_documented_integer_definition(n):
    positions = sorted({0, n - 1, *np.random.default_rng(n % 1000).integers(0, n, 50).tolist()})
    words = (12345, SHARD_TAG)
    assert permute(n, words, positions).tolist() == [reference(n, words, i) for i in positions]


def test_pinned_values_the_same_on_every_machine():
    """Any change here changes every job's shards: the definition is docs/engine.md's."""
    assert permute(10, (0, SHARD_TAG), np.arange(10)).tolist() == [
        reference(10, (0, SHARD_TAG), i) for i in range(10)]
    assert permute(10, (0, SHARD_TAG), np.arange(10)).tolist() == PINNED_10
    assert shard_indices(20, 3, 7)[1].tolist() == PINNED_SHARD


PINNED_10 = [6, 2, 0, 5, 1, 9, 8, 7, 4, 3]
PINNED_SHARD = [5, 17, 16, 12, 1, 9, 7]


def test_a_pure_function_of_its_words_and_positions():
    a = permute(1000, (1, 2), np.arange(1000))
    assert np.array_equal(a, permute(1000, (1, 2), np.arange(1000)))
    assert not np.array_equal(a, permute(1000, (2, 1), np.arange(1000)))
    assert not np.array_equal(a, permute(1000, (1, 3), np.arange(1000)))
    picked = np.array([999, 0, 17, 17, 512])
    assert np.array_equal(permute(1000, (1, 2), picked), a[picked])


def test_positions_outside_the_range_are_refused():
    with pytest.raises(IndexError):
        permute(10, (0,), [10])
    with pytest.raises(IndexError):
        permute(10, (0,), [-1])
    with pytest.raises(ValueError):
        permute(0, (0,), [])


def test_it_looks_uniform():
    """Where each position lands, over many seeds: every cell near its expected count."""
    n, seeds = 8, 4000
    counts = np.zeros((n, n))
    for s in range(seeds):
        counts[np.arange(n), permute(n, (s, 9), np.arange(n))] += 1
    expected = seeds / n
    assert np.abs(counts - expected).max() < 5 * np.sqrt(expected)


def test_shards_are_cut_as_array_split_cuts():
    for n, shards in ((1438, 16), (10, 3), (7, 7), (100, 1)):
        sizes = [len(p) for p in np.array_split(np.arange(n), shards)]
        assert [shard_length(n, shards, k) for k in range(shards)] == sizes
        assert shard_bounds(n, shards, 0)[0] == 0 and shard_bounds(n, shards, shards - 1)[1] == n
    with pytest.raises(ValueError):
        shard_bounds(10, 3, 3)
    with pytest.raises(ValueError):
        shard_bounds(2, 3, 0)


def test_a_shards_chunks_join_to_the_whole_split():
    n, shards, seed = 10_007, 6, 11
    whole = shard_indices(n, shards, seed)
    for k in range(shards):
        size = shard_length(n, shards, k)
        chunks = [shard_samples(n, shards, seed, k, start, start + 700)
                  for start in range(0, size, 700)]
        assert np.array_equal(np.concatenate(chunks), whole[k])
    assert np.array_equal(shard_samples(n, shards, seed, 2, 5, 9), whole[2][5:9])
    assert len(shard_samples(n, shards, seed, 2, 5000, 6000)) == 0  # past the shard's end


def test_a_chunk_of_a_shard_of_a_huge_dataset_costs_the_chunk():
    """2^40 samples (a permutation of them would be 8 TiB): 10,000 of shard 3's, found with
    well under a megabyte of temporaries."""
    n = 2**40
    tracemalloc.start()
    try:
        got = shard_samples(n, 1000, 0, 3, 123_456, 133_456)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    lo, hi = shard_bounds(n, 1000, 3)
    assert len(got) == 10_000 and got.min() >= 0 and got.max() < n
    assert len(np.unique(got)) == 10_000
    assert peak < 2 << 20, peak
    assert got[:3].tolist() == [reference(n, (0, SHARD_TAG), lo + 123_456 + i) for i in range(3)]
