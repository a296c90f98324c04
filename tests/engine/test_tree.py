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


def test_cover_walks_only_what_is_held_so_a_big_plan_stays_cheap(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan covers every device's run (POST /jobs?dry_run=true): at 4096 shards and devices
    a walk of the whole tree per device was seconds of CPU a request. Counting the nodes visited
    shows the walk stays near the held run, whatever the tree's size."""
    visited = 0
    real_split = tree.split

    def counting_split(lo: int, hi: int) -> int:
        nonlocal visited
        visited += 1
        return real_split(lo, hi)

    monkeypatch.setattr(tree, "split", counting_split)
    assert tree.cover([2049], 1 << 20) == [(2049, 2050)]
    assert visited <= 21  # one split per level down to the leaf, nothing beside it
    assert tree.cover([], 8) == [] and tree.cover([9, -1], 8) == []


@pytest.mark.parametrize(("todo", "most", "first", "rest"), [
    (list(range(8)), 1, [0], list(range(1, 8))),                 # the first, measuring request
    (list(range(1, 8)), 8, list(range(1, 8)), []),               # [1,2) [2,4) [4,8): all fit
    (list(range(1, 8)), 4, [1, 2, 3], [4, 5, 6, 7]),             # [4,8) would not fit: next time
    (list(range(8, 16)), 5, [8, 9, 10, 11], [12, 13, 14, 15]),   # the head of a larger block
    ([3, 5, 6, 7], 3, [3, 5], [6, 7]),                           # gaps: leaves, then [6,8)
    ([4, 5, 6], 64, [4, 5, 6], []),
    (list(range(31, 64)), 20, list(range(31, 48)), list(range(48, 64))),  # [32,64) cut anyway
])
def test_a_phone_asks_for_whole_aligned_blocks(todo: list[int], most: int, first: list[int],
                                               rest: list[int]) -> None:
    assert tree.next_blocks(todo, most) == (first, rest)


def test_next_blocks_never_cuts_an_aligned_node_that_fits_a_request() -> None:
    """What a phone computes together goes up as one partial per node it fills: a node of the
    phone's cover that fits one request must never be cut between two (one upload per piece)."""
    rng = random.Random(3)
    for _ in range(300):
        shards = rng.randint(1, 300)
        todo = sorted(rng.sample(range(shards), rng.randint(1, shards)))
        most, chunks, left = rng.randint(1, 40), [], todo
        while left:
            chunk, left = tree.next_blocks(left, most)
            assert 1 <= len(chunk) <= most and chunk == sorted(chunk)
            chunks.append(set(chunk))
        assert sorted(k for c in chunks for k in c) == todo
        for lo, hi in tree.cover(todo, shards):
            size = hi - lo
            if size <= most and size & (size - 1) == 0:
                assert any(set(range(lo, hi)) <= c for c in chunks), (lo, hi)


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


def random_cover(rng: random.Random, shards: int) -> set[tree.Node]:
    """Leaves and partials covering every shard once: each node kept whole or split."""
    have: set[tree.Node] = set()
    todo = [(0, shards)]
    while todo:
        lo, hi = todo.pop()
        if hi - lo == 1 or rng.random() < 0.25:
            have.add((lo, hi))
        else:
            mid = tree.split(lo, hi)
            todo += [(lo, mid), (mid, hi)]
    return have


def run_plan(how: tree.Plan, values: dict[tree.Node, str]) -> str:
    """A plan's additions made with strings into its slots, as engine.step makes them with
    arrays: a slot overwritten while still needed, or a pair out of order, shows."""
    given = [values[node] for node in how.given]
    slots = [""] * how.slots
    for left, right, out in how.adds:
        x = given[left] if left >= 0 else slots[~left]
        y = given[right] if right >= 0 else slots[~right]
        slots[out] = f"({x}+{y})"
    return given[how.root] if how.root >= 0 else slots[~how.root]


@pytest.mark.parametrize("shards", [1, 2, 3, 5, 8, 13, 138])
def test_a_plan_adds_reduces_pairs_in_few_slots_never_overwriting_a_value_still_needed(
        shards: int) -> None:
    rng = random.Random(shards)
    for _ in range(20):
        have = random_cover(rng, shards)
        values = {node: f"[{node[0]},{node[1]})" for node in have}
        how = tree.plan(have, 0, shards)
        assert run_plan(how, values) == tree.reduce(values, 0, shards, lambda a, b: f"({a}+{b})")
        assert how.slots <= 2 * (shards - 1).bit_length()  # two a level, whatever the cover
    with pytest.raises(KeyError, match="shard 1"):
        tree.plan({(0, 1), (2, 4)}, 0, 4)


@pytest.mark.parametrize("shards", [1, 2, 3, 7, 8, 138])
def test_nodes_are_exactly_the_trees_nodes(shards: int) -> None:
    """The keys a step's results may have: every node once, and nothing that is not one."""
    from engine.tree import is_node, nodes

    got = nodes(shards)
    assert len(got) == len(set(got)) == 2 * shards - 1
    assert set(got) == {(lo, hi) for lo in range(shards) for hi in range(lo + 1, shards + 1)
                        if is_node(lo, hi, shards)}


@pytest.mark.parametrize("shards", [1, 5, 8, 138])
def test_nodes_over_some_shards_are_the_nodes_holding_one_of_them(shards: int) -> None:
    """What a work answer asks about: the nodes whose results would cover a device's shards."""
    from engine.tree import nodes

    rng = random.Random(shards)
    for held in ([], [0], [shards - 1], rng.sample(range(shards), min(3, shards)),
                 list(range(shards))):
        got = nodes(shards, held)
        assert got == [(lo, hi) for lo, hi in nodes(shards) if any(lo <= k < hi for k in held)]
    assert len(nodes(138, [5])) == 9  # the path from the root to shard 5
