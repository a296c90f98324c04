"""The canonical reduction tree: its nodes, a phone's cover, the server's choice of partials."""

from __future__ import annotations

import random

import pytest

from engine import tree


def nodes(shards: int) -> set[tree.Node]:
    out: set[tree.Node] = set()

    def walk(lo: int, hi: int) -> None:
        out.add((lo, hi))
        if hi - lo > 1:
            mid = tree.split(lo, hi)
            walk(lo, mid)
            walk(mid, hi)

    walk(0, shards)
    return out


@pytest.mark.parametrize("shards", [1, 2, 3, 5, 8, 13, 552])
def test_every_left_child_is_an_aligned_power_of_two_and_is_node_agrees(shards: int) -> None:
    every = nodes(shards)
    assert len(every) == 2 * shards - 1  # a binary tree over `shards` leaves
    for lo, hi in every:
        if hi - lo > 1:
            mid = tree.split(lo, hi)
            size = mid - lo
            assert size & (size - 1) == 0 and lo % size == 0 and hi - mid <= size
    for lo in range(shards):
        for hi in range(lo + 1, shards + 1):
            assert tree.is_node(lo, hi, shards) == ((lo, hi) in every)
    assert not tree.is_node(0, shards + 1, shards) and not tree.is_node(-1, 1, shards)


def test_a_phone_holding_an_aligned_block_uploads_one_partial_and_a_ragged_run_few() -> None:
    assert tree.cover(range(8, 16), 552) == [(8, 16)]
    assert tree.cover(range(4, 8), 552) == [(4, 8)]
    assert tree.cover(range(3, 9), 16) == [(3, 4), (4, 8), (8, 9)]
    assert tree.cover({0, 2, 5}, 8) == [(0, 1), (2, 3), (5, 6)]  # non-contiguous: leaves
    assert tree.cover(range(6), 6) == [(0, 6)]  # all of a ragged job: its root
    for _ in range(200):  # a contiguous run of k: at most 2 log2 k + 2 nodes, covering it once
        shards = random.randint(1, 600)
        lo = random.randrange(shards)
        hi = random.randint(lo + 1, shards)
        got = tree.cover(range(lo, hi), shards)
        assert sorted(k for a, b in got for k in range(a, b)) == list(range(lo, hi))
        assert len(got) <= 2 * (hi - lo).bit_length() + 2


def test_the_server_chooses_one_cover_preferring_the_larger_node() -> None:
    assert tree.choose({(0, 4), (2, 3), (4, 8)}, 8) == [(0, 4), (4, 8)]
    assert tree.choose({(0, 2), (2, 3), (3, 4), (4, 8)}, 8) == [(0, 2), (2, 3), (3, 4), (4, 8)]
    assert tree.choose({(0, 4), (5, 6)}, 8) is None  # 4, 6 and 7 missing
    assert tree.choose({(0, 1), (1, 2), (2, 3)}, 3) == [(0, 1), (1, 2), (2, 3)]


def test_reduce_adds_in_the_trees_pairs() -> None:
    leaves = {(k, k + 1): str(k) for k in range(5)}

    def pair(a: str, b: str) -> str:
        return f"({a}+{b})"

    assert tree.reduce(leaves, 0, 5, pair) == "(((0+1)+(2+3))+4)"
    assert tree.reduce({(0, 4): "P", (4, 5): "4"}, 0, 5, pair) == "(P+4)"
