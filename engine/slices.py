"""The parameter vector cut into slices that are applied apart (issue 21 item 2).

A job with `slices: P` has its vector cut into P contiguous ranges, fixed at job start; each
slice's step is reduced and updated by its own task (scheduler.apply), reading only its
range of the uploaded gradients and of the optimizer state, so a step's CPU and bytes spread
over the workers. Cuts fall between parameter tensors: every per-tensor rule (LARS's trust
ratio needs a tensor's whole norm) stays inside one slice. Every other rule is element-wise
(the tree's sums, SGD, AdamW), so a sliced step is the whole step bit for bit (tested).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from engine.base import Slot

MAX_SLICES = 64

Bounds = tuple[int, int]


class SliceError(ValueError):
    pass


def slice_bounds(slots: Sequence[Slot], n_params: int, parts: int) -> list[Bounds]:
    """`parts` contiguous ranges covering [0, n_params), cut at tensor boundaries, the largest
    as small as the tensors allow (at least the largest tensor: mobilenet_v1's last pointwise
    kernel is a third of it). Refused: more slices than tensors."""
    if parts < 1:
        raise SliceError("slices must be >= 1")
    edges = sorted({0, *(s.offset for s in slots if 0 < s.offset < n_params), n_params})
    sizes = [b - a for a, b in zip(edges[:-1], edges[1:])]
    if len(sizes) < parts:
        raise SliceError(f"slices ({parts}) exceeds this model's {len(sizes)} parameter "
                         f"tensors: a slice is cut between tensors, never inside one")
    # the smallest capacity that packs the tensors, in order, into at most `parts` slices
    low, high = max(max(sizes), -(-n_params // parts)), n_params
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if len(_pack(sizes, mid)) <= parts else (mid + 1, high)
    groups = _pack(sizes, low)
    while len(groups) < parts:  # split the largest divisible slice: the largest never grows
        i = max((i for i, g in enumerate(groups) if len(g) > 1), key=lambda i: sum(groups[i]))
        g = groups[i]
        half = min(range(1, len(g)), key=lambda j: abs(sum(g[:j]) - sum(g[j:])))
        groups[i : i + 1] = [g[:half], g[half:]]
    points = [0]
    for g in groups:
        points.append(points[-1] + sum(g))
    return list(zip(points[:-1], points[1:]))


def _pack(sizes: list[int], capacity: int) -> list[list[int]]:
    """Tensors in order into slices of at most `capacity` (a tensor larger: alone)."""
    groups: list[list[int]] = [[]]
    for size in sizes:
        if groups[-1] and sum(groups[-1]) + size > capacity:
            groups.append([])
        groups[-1].append(size)
    return groups


def slots_within(slots: Sequence[Slot], lo: int, hi: int) -> list[Slot]:
    """The tensors of [lo, hi), offsets counted from lo (the optimizer's view of a slice)."""
    return [replace(s, offset=s.offset - lo) for s in slots
            if lo <= s.offset and s.offset + s.size <= hi]
