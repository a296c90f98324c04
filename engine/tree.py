"""The canonical reduction tree over a step's shards: the one order every sum of shard results
follows, wherever it is computed (issue 21 item 1).

A node is a half-open shard range [lo, hi). The root is [0, shards); a node of n >= 2 shards
splits at lo + (the largest power of two below n), so the left child is always a full,
aligned power-of-two block and the right child is what is left. The tree is a pure function of
the shard count, so a phone holding shards 4..7 of 16 can add them into node [4, 8) itself and
upload one partial: the server, the reference trainer and every phone then add the same values
in the same pairs, and the step is the same bit for bit whoever added what.

Helpers here know ranges only; engine.step adds the values.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

Node = tuple[int, int]  # [lo, hi)
T = TypeVar("T")


def split(lo: int, hi: int) -> int:
    """Where node [lo, hi) of two or more shards splits into its children."""
    n = hi - lo
    if n < 2:
        raise ValueError(f"node [{lo}, {hi}) is a leaf: nothing to split")
    return lo + (1 << ((n - 1).bit_length() - 1))


def is_node(lo: int, hi: int, shards: int) -> bool:
    """Whether [lo, hi) is a node of the tree over `shards` shards."""
    if not 0 <= lo < hi <= shards:
        return False
    a, b = 0, shards
    while (a, b) != (lo, hi):
        if b - a < 2:
            return False
        mid = split(a, b)
        if hi <= mid:
            b = mid
        elif lo >= mid:
            a = mid
        else:
            return False
    return True


def nodes(shards: int, over: Collection[int] | None = None) -> list[Node]:
    """Every node of the tree over `shards` shards (2 x shards - 1 of them), root first; with
    `over`, only those holding one of its shards (the paths from the root to them: about
    len(over) x log2(shards) nodes)."""
    wanted = None if over is None else sorted({k for k in over if 0 <= k < shards})
    out: list[Node] = []
    todo = [(0, shards)] if shards > 0 else []
    while todo:
        lo, hi = todo.pop()
        if wanted is not None and bisect.bisect_left(wanted, hi) == bisect.bisect_left(wanted, lo):
            continue  # none of `over` inside
        out.append((lo, hi))
        if hi - lo > 1:
            mid = split(lo, hi)
            todo += [(mid, hi), (lo, mid)]
    return out


def cover(held: Collection[int], shards: int) -> list[Node]:
    """The largest nodes made only of shards in `held`, in shard order: what a phone holding
    `held` uploads (one partial each; a contiguous run of k shards is at most ~2 log2 k nodes).
    Only nodes partly held are walked (counted by bisection in the sorted held shards), so the
    cost is O(len(cover) x log(shards)) whatever the tree's size: the plan calls it per device."""
    have = sorted({k for k in held if 0 <= k < shards})
    out: list[Node] = []

    def walk(lo: int, hi: int) -> None:
        inside = bisect.bisect_left(have, hi) - bisect.bisect_left(have, lo)
        if inside == hi - lo:
            out.append((lo, hi))
        elif inside:
            mid = split(lo, hi)
            walk(lo, mid)
            walk(mid, hi)

    if have:
        walk(0, shards)
    return out


def next_blocks(todo: Sequence[int], most: int) -> tuple[list[int], list[int]]:
    """Split sorted, distinct shards `todo` into what to compute next and what is left: whole
    aligned power-of-two runs from the start (so what is computed together fills tree nodes and
    goes up as few partials), as many as fit in `most` shards; at least one shard. A run larger
    than any request is cut into heads of the largest power of two that fits. (The ragged nodes
    at the right edge of a tree over a non-power-of-two count are not kept whole: at worst one
    more upload.)"""
    top = 1 << (max(1, most).bit_length() - 1)  # the largest aligned block a request can hold
    taken = 0
    while taken < len(todo):
        lo, size = todo[taken], 1
        while (lo % (2 * size) == 0 and taken + 2 * size <= len(todo)
               and todo[taken + 2 * size - 1] == lo + 2 * size - 1):
            size *= 2
        if taken + size > most:
            if size > most and taken + top <= most:
                size = top  # cut in any case: its head, as large as a request may hold
            elif taken:
                break
            else:
                size = top
        taken += size
    return list(todo[:taken]), list(todo[taken:])


@dataclass(frozen=True)
class Plan:
    """`reduce`'s additions for node [lo, hi) laid out once, for values added a block at a
    time (engine.step): `adds` in order, each (left, right, out). An operand >= 0 is the index
    of a given node in `given`; < 0 is scratch slot ~operand, written by an earlier add. `out`
    is a slot; `root` the operand holding the node's value. A node at depth d writes slot
    2d (a left child) or 2d + 1 (a right one): a left child's value is held while its sibling's
    subtree is added in deeper slots, so 2 x depth slots do for any shard count."""

    given: tuple[Node, ...]
    adds: tuple[tuple[int, int, int], ...]
    root: int
    slots: int


def plan(have: Collection[Node], lo: int, hi: int) -> Plan:
    """The additions that make node [lo, hi) from nodes in `have` covering it (none above
    it), in the order and pairs `reduce` adds them."""
    given: list[Node] = []
    adds: list[tuple[int, int, int]] = []
    root = _plan_node(have, lo, hi, 0, 0, given, adds)
    return Plan(tuple(given), tuple(adds), root, 1 + max((out for *_, out in adds), default=-1))


def _plan_node(have: Collection[Node], lo: int, hi: int, depth: int, side: int,
               given: list[Node], adds: list[tuple[int, int, int]]) -> int:
    # a function of the module, not a closure calling itself: that would be a reference
    # cycle holding `have` (a step's results, model-sized uploads) until the cyclic GC runs
    if (lo, hi) in have:
        given.append((lo, hi))
        return len(given) - 1
    if hi - lo < 2:
        raise KeyError(f"shard {lo} has no value")
    mid = split(lo, hi)
    left = _plan_node(have, lo, mid, depth + 1, 0, given, adds)
    right = _plan_node(have, mid, hi, depth + 1, 1, given, adds)
    adds.append((left, right, 2 * depth + side))
    return ~(2 * depth + side)


def choose(available: Collection[Node], shards: int) -> list[Node] | None:
    """Nodes out of `available` that together cover every shard exactly once, the largest
    preferred (a partial and a straggler's backup of one of its shards may both be stored:
    equal bits, so either would do); None when some shard is covered by none."""
    have = set(available)
    out: list[Node] = []

    def walk(lo: int, hi: int) -> bool:
        if (lo, hi) in have:
            out.append((lo, hi))
            return True
        if hi - lo < 2:
            return False
        mid = split(lo, hi)
        return walk(lo, mid) and walk(mid, hi)

    return out if walk(0, shards) else None


def reduce(values: Mapping[Node, T], lo: int, hi: int, add: Callable[[T, T], T]) -> T:
    """Node [lo, hi)'s value from `values`, which must hold nodes covering it (none above it):
    each missing node is add(left child, right child)."""
    if (lo, hi) in values:
        return values[(lo, hi)]
    if hi - lo < 2:
        raise KeyError(f"shard {lo} has no value")
    mid = split(lo, hi)
    return add(reduce(values, lo, mid, add), reduce(values, mid, hi, add))
