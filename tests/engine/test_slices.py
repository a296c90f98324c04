"""A step applied slice by slice is the whole step, bit for bit (issue 21 item 2)."""

from __future__ import annotations

from dataclasses import replace
from itertools import combinations

import numpy as np
import pytest

from engine.base import Slot
from engine.data import load_dataset
from engine.models import build_model
from engine.sampler import select_microbatch, shard_indices
from engine.slices import SliceError, slice_bounds, slots_within
from engine.spec import SpecError, TrainSpec
from engine.step import apply_step, compute_shard, cut_state, initial_state, join_states

OPTIMIZERS = {
    "sgd": {"type": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4, "nesterov": True},
    "adamw": {"type": "adamw", "lr": 0.01, "weight_decay": 0.05},
    "lars": {"type": "lars", "lr": 0.5, "weight_decay": 1e-4, "trust_coefficient": 0.01},
}


def _job(optimizer: str, slices: int = 1) -> dict:
    return {"model": {"arch": "resnet", "width": 0.5}, "dataset": "digits",
            "global_batch_size": 64, "shards": 4, "epochs": 1, "seed": 3,
            "optimizer": OPTIMIZERS[optimizer], "slices": slices}


def _state_bytes(s) -> bytes:
    return b"".join(np.ascontiguousarray(a, np.float32).tobytes()
                    for a in (s.params, s.opt_state, s.buffers))


@pytest.mark.parametrize("optimizer", sorted(OPTIMIZERS))
@pytest.mark.parametrize("parts", [2, 3, 7])
def test_a_step_applied_in_slices_is_the_whole_step_bit_for_bit(optimizer: str, parts: int) -> None:
    data = load_dataset("digits")
    spec = TrainSpec.from_job_spec(_job(optimizer, parts), n_train=len(data.y_train))
    model = build_model(spec.arch, data.input_shape, data.num_classes, spec.model_options)
    shards = [(data.x_train[i], data.y_train[i])
              for i in shard_indices(len(data.y_train), spec.shards, spec.seed)]
    bounds = slice_bounds(list(model.layout.values()), model.n_params, parts)
    whole = sliced = initial_state(model, spec)
    for _ in range(3):  # momentum, moments and BN buffers move: every part of the state counts
        results = []
        for k, (xs, ys) in enumerate(shards):
            xb, yb = select_microbatch(xs, ys, spec.per_shard_batch, spec.seed, whole.step, k,
                                       spec.steps_per_epoch)
            results.append(compute_shard(model, whole.params, whole.buffers, xb, yb, spec,
                                         whole.step, k))
        whole, metrics = apply_step(model, spec, whole, results)
        pieces = []
        for lo, hi in bounds:
            part_results = [replace(r, grad_sum=r.grad_sum[lo:hi]) for r in results]
            piece, m = apply_step(model, spec, cut_state(sliced, (lo, hi)), part_results,
                                  part=(lo, hi))
            assert m == metrics  # every slice sees the same loss, accuracy and samples
            pieces.append(piece)
        sliced = join_states(pieces, bounds)
        assert _state_bytes(sliced) == _state_bytes(whole)
    assert model.n_buffers  # the case where slice 0 carries the BN buffers is exercised


def test_cuts_fall_between_tensors_as_evenly_as_they_allow() -> None:
    slots = [Slot(f"t{i}", off, (size,)) for i, (off, size) in
             enumerate([(0, 10), (10, 40), (50, 10), (60, 30), (90, 10)])]
    assert slice_bounds(slots, 100, 1) == [(0, 100)]
    assert slice_bounds(slots, 100, 2) == [(0, 50), (50, 100)]
    assert max(hi - lo for lo, hi in slice_bounds(slots, 100, 3)) == 50  # 10+40 | 10+30 | 10, or so
    assert slice_bounds(slots, 100, 5) == [(0, 10), (10, 50), (50, 60), (60, 90), (90, 100)]
    for parts in range(1, 6):  # always a partition into whole tensors
        bounds = slice_bounds(slots, 100, parts)
        assert bounds[0][0] == 0 and bounds[-1][1] == 100 and len(bounds) == parts
        assert all(a[1] == b[0] for a, b in zip(bounds, bounds[1:]))
        edges = {s.offset for s in slots}
        assert all(lo in edges for lo, _ in bounds)
    with pytest.raises(SliceError, match="exceeds this model's 5 parameter tensors"):
        slice_bounds(slots, 100, 6)
    assert [s.offset for s in slots_within(slots, 50, 90)] == [0, 10]


def test_a_real_model_is_cut_evenly() -> None:
    model = build_model("mobilenet_v1", (3, 32, 32), 10, {"width": 1.0})
    bounds = slice_bounds(list(model.layout.values()), model.n_params, 8)
    sizes = [hi - lo for lo, hi in bounds]
    largest = max(s.size for s in model.layout.values())  # 1024 x 1024: a third of the model
    assert max(sizes) == largest and len(sizes) == 8


def test_the_spec_refuses_a_slice_count_out_of_range() -> None:
    with pytest.raises(SpecError, match="slices must be in"):
        TrainSpec.from_job_spec({"model": {"arch": "cnn"}, "dataset": "digits", "slices": 0})
    with pytest.raises(SpecError, match="slices must be in"):
        TrainSpec.from_job_spec({"model": {"arch": "cnn"}, "dataset": "digits", "slices": 65})


def _slots(sizes: list[int]) -> list[Slot]:
    offsets = np.cumsum([0, *sizes[:-1]])
    return [Slot(f"t{i}", int(off), (size,)) for i, (off, size) in enumerate(zip(offsets, sizes))]


def _best_largest(sizes: list[int], parts: int) -> int:
    """The least largest slice over every way to cut `sizes`, in order, into `parts` slices."""
    edges = np.cumsum([0, *sizes])
    return min(max(int(edges[b] - edges[a]) for a, b in zip((0, *cut), (*cut, len(sizes))))
               for cut in combinations(range(1, len(sizes)), parts - 1))


def test_the_largest_slice_is_the_least_any_cut_between_tensors_allows() -> None:
    rng = np.random.default_rng(11)
    for _ in range(300):
        sizes = [int(s) for s in rng.integers(1, 20, size=int(rng.integers(1, 8)))]
        for parts in range(1, len(sizes) + 1):
            bounds = slice_bounds(_slots(sizes), sum(sizes), parts)
            assert len(bounds) == parts, (sizes, parts, bounds)
            assert max(hi - lo for lo, hi in bounds) == _best_largest(sizes, parts), (sizes, parts)


@pytest.mark.parametrize(("sizes", "parts", "expected"), [
    # one tensor of one element first: its end is a cut like any other
    ([1, 4, 5], 3, [(0, 1), (1, 5), (5, 10)]),
    # packed into 2 at the least capacity (10), then the largest divisible slice is halved as
    # evenly as it goes (2+1+1 | 3+3), then again the largest ([3, 3])
    ([10, 2, 1, 1, 3, 3], 4, [(0, 10), (10, 14), (14, 17), (17, 20)]),
    # two divisible slices of equal size: the first is split
    ([5, 1, 1, 5, 1, 1], 5, [(0, 5), (5, 6), (6, 7), (7, 12), (12, 14)]),
])
def test_how_slices_are_split_to_reach_their_count(sizes, parts, expected) -> None:
    assert slice_bounds(_slots(sizes), sum(sizes), parts) == expected


def test_zero_slices_are_refused_saying_so() -> None:
    with pytest.raises(SliceError) as refused:
        slice_bounds(_slots([3, 4]), 7, 0)
    assert str(refused.value) == "slices must be >= 1"
