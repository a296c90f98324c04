"""Placement cannot change the math: any grouping of shards gives the same step."""

from __future__ import annotations

import random

import numpy as np
import pytest

from engine.data import load_dataset
from engine.models import build_model
from engine.optim import SUM_BLOCK, ordered_sum
from engine.precision import round_to
from engine.sampler import select_microbatch, shard_indices
from engine.spec import TrainSpec
from engine.step import (
    BN_MOMENTUM,
    REDUCE_BLOCK,
    ShardResult,
    apply_step,
    compute_shard,
    initial_state,
    pre_reduce,
    reduce_results,
)
from tests.support.optional import require
from wire.messages import decode_results, encode_results

JOB = {"model": {"arch": "resnet", "width": 0.5}, "dataset": "digits", "global_batch_size": 64,
       "shards": 8, "epochs": 2, "seed": 4,
       "optimizer": {"lr": 0.1, "momentum": 0.9, "weight_decay": 1e-4, "warmup_epochs": 1}}


@pytest.fixture(scope="module")
def setup():
    data = load_dataset("digits")
    spec = TrainSpec.from_job_spec(JOB, n_train=len(data.y_train))
    model = build_model(spec.arch, data.input_shape, data.num_classes, spec.model_options)
    shards = [(data.x_train[i], data.y_train[i]) for i in shard_indices(len(data.y_train),
                                                                        spec.shards, spec.seed)]
    state = initial_state(model, spec)
    for _ in range(2):  # move off the initial point so momentum and buffers are non-trivial
        state, _ = apply_step(model, spec, state, _results(model, spec, state, shards))
    return model, spec, shards, state


def _results(model, spec, state, shards, keep=None, backend="numpy"):
    out = []
    for k, (xs, ys) in enumerate(shards):
        if keep is None or k in keep:
            xb, yb = select_microbatch(xs, ys, spec.per_shard_batch, spec.seed, state.step, k,
                                       spec.steps_per_epoch)
            out.append(compute_shard(model, state.params, state.buffers, xb, yb, spec,
                                     state.step, k, backend))
    return out


def _close(a, b, rel=1e-6):
    for name in ("params", "opt_state", "buffers"):
        x, y = getattr(a, name), getattr(b, name)
        assert np.abs(x - y).max() <= rel * max(np.abs(y).max(), 1e-30), name


def test_one_group_three_groups_and_shuffled_order_give_the_same_step(setup):
    model, spec, shards, state = setup
    reference, ref_metrics = apply_step(model, spec, state, _results(model, spec, state, shards))
    groups = [{0, 3, 6}, {1, 4, 7}, {2, 5}]  # three devices, each uploading over the wire
    received = []
    for g in groups:
        body = encode_results("job-1", state.step, _results(model, spec, state, shards, g))
        received += decode_results(body, "job-1", state.step, model.n_params, model.n_stats)
    grouped, metrics = apply_step(model, spec, state, received)
    _close(grouped, reference)
    random.Random(0).shuffle(received)
    shuffled, _ = apply_step(model, spec, state, received)
    _close(shuffled, reference)
    assert grouped.step == state.step + 1 and metrics == ref_metrics


def test_devices_mixing_numpy_and_torch_give_the_same_step(setup):
    require("torch")
    model, spec, shards, state = setup
    reference, _ = apply_step(model, spec, state, _results(model, spec, state, shards))
    mixed = (_results(model, spec, state, shards, {0, 1, 2, 3})
             + _results(model, spec, state, shards, {4, 5, 6, 7}, backend="torch"))
    after, _ = apply_step(model, spec, state, mixed)
    _close(after, reference)


def test_a_recomputed_straggler_shard_is_bit_identical(setup):
    model, spec, shards, state = setup
    a = _results(model, spec, state, shards, {5})[0]
    b = _results(model, spec, state, shards, {5})[0]
    assert a.grad_sum.tobytes() == b.grad_sum.tobytes() and a.loss_sum == b.loss_sum


def test_metrics_and_batchnorm_buffers_come_from_every_shard(setup):
    model, spec, shards, state = setup
    results = _results(model, spec, state, shards)
    after, metrics = apply_step(model, spec, state, results)
    assert metrics.samples == spec.global_batch_size
    assert metrics.train_loss == pytest.approx(sum(r.loss_sum for r in results) / 64)
    assert metrics.train_accuracy == sum(r.correct for r in results) / 64
    mean_stats = np.mean([r.stats for r in results], axis=0)
    np.testing.assert_allclose(
        after.buffers, (1 - BN_MOMENTUM) * state.buffers + BN_MOMENTUM * mean_stats, rtol=1e-5)


def test_a_missing_shard_or_a_range_that_is_no_node_is_refused(setup):
    model, spec, shards, state = setup
    with pytest.raises(ValueError, match=r"missing \[3\]"):
        apply_step(model, spec, state, _results(model, spec, state, shards, set(range(8)) - {3}))
    leaves = _results(model, spec, state, shards)
    odd = reduce_results(leaves[1:3], 1, 3, spec.upload_precision)  # [1, 3) is no node
    with pytest.raises(ValueError, match=r"shards 1\.\.2 are not a node"):
        apply_step(model, spec, state, [leaves[0], odd, *leaves[3:]])


def _state_bytes(s) -> bytes:
    return s.params.tobytes() + s.opt_state.tobytes() + s.buffers.tobytes()


@pytest.mark.parametrize("holdings", [
    [range(0, 4), range(4, 8)],                 # aligned: one partial each
    [range(0, 3), range(3, 8)],                 # not aligned: [0,2)+[2,3), [3,4)+[4,8)
    [range(0, 1), range(1, 7), range(7, 8)],    # [1,2)+[2,4)+[4,6)+[6,7)
    [range(0, 8)],                              # one phone holds everything: the root
])
def test_phones_pre_adding_the_shards_they_hold_give_the_same_step_bit_for_bit(setup, holdings):
    """Invariant 1 with issue 21's pre-reduce: however the shards are split between phones and
    pre-added there, and whatever order the partials arrive in, the step is the same bits as the
    reference trainer's (which adds every shard's own result up the same tree)."""
    model, spec, shards, state = setup
    reference, ref_metrics = apply_step(model, spec, state, _results(model, spec, state, shards))
    received = []
    for held in holdings:
        leaves = _results(model, spec, state, shards, set(held))
        partials = pre_reduce(leaves, spec.shards, spec.upload_precision)
        assert len(partials) <= 1 + 2 * max(1, (len(held) - 1).bit_length())
        body = encode_results("job-1", state.step, partials)
        received += decode_results(body, "job-1", state.step, model.n_params, model.n_stats)
    random.Random(len(received)).shuffle(received)
    after, metrics = apply_step(model, spec, state, received)
    assert _state_bytes(after) == _state_bytes(reference) and metrics == ref_metrics


def test_a_partial_and_a_backup_of_one_of_its_shards_are_added_once(setup):
    """A straggler's shard recomputed elsewhere while its phone's partial also lands: both are
    stored, the step adds the shard once (the larger node; the bits are equal)."""
    model, spec, shards, state = setup
    leaves = _results(model, spec, state, shards)
    reference, _ = apply_step(model, spec, state, leaves)
    both = [*pre_reduce(leaves[:4], spec.shards, spec.upload_precision), leaves[2], *leaves[4:]]
    after, metrics = apply_step(model, spec, state, both)
    assert _state_bytes(after) == _state_bytes(reference)
    assert metrics.samples == spec.global_batch_size
    # adding them directly too: the backup inside the partial's range is not counted again
    total = reduce_results(both, 0, spec.shards, spec.upload_precision)
    assert total.count == spec.global_batch_size and total.span == spec.shards


def test_the_blocked_tree_sum_is_the_whole_vector_tree_bit_for_bit() -> None:
    """Adding block by block must not change one bit against adding whole vectors up the tree;
    and it is the tree's pairing that counts: adding in shard order differs somewhere."""
    n, k = 2 * REDUCE_BLOCK + 77, 6
    rng = np.random.default_rng(k)
    results = [ShardResult(i, (rng.standard_normal(n) * 10.0 ** rng.integers(-6, 6, n))
                           .astype(np.float32), 1.0, 0, 1, np.zeros(2, np.float32))
               for i in range(k)]
    got = reduce_results(results, 0, k, "float32").grad_sum
    # [0, 6) = ([0,4) = ([0,2) + [2,4))) + [4,6): written out by hand
    g = [r.grad_sum for r in results]
    want = ((g[0] + g[1]) + (g[2] + g[3])) + (g[4] + g[5])
    assert got.tobytes() == want.tobytes()
    in_order = g[0].copy()
    for a in g[1:]:
        in_order = in_order + a
    assert in_order.tobytes() != want.tobytes()


def test_float16_sums_stay_float32_and_float16_phones_upload_leaves() -> None:
    """Shard results near float16's top add past 65504: rounding the tree's nodes to float16
    would make them infinite (NaN parameters on the server). Nodes stay float32 for float16
    jobs, and a phone's results go up as they are (no partial could travel in float16)."""
    rng = np.random.default_rng(4)
    leaves = [ShardResult(i, round_to(rng.uniform(30000, 60000, 1000).astype(np.float32),
                                      "float16"), 1.0, 0, 1, np.zeros(2, np.float32))
              for i in range(4)]
    total = reduce_results(leaves, 0, 4, "float16").grad_sum
    assert np.isfinite(total).all() and np.abs(total).max() > 65504
    g = [r.grad_sum for r in leaves]
    assert total.tobytes() == ((g[0] + g[1]) + (g[2] + g[3])).tobytes()  # float32, unrounded
    assert pre_reduce(leaves[:2], 4, "float16") == leaves[:2]


@pytest.mark.parametrize("shards", [2, 16, 552])
def test_bfloat16_partials_travel_in_bfloat16_within_a_rounding_a_level(shards: int) -> None:
    """A bfloat16 job's partials are rounded to bfloat16 at every node (so a partial of many
    shards is still half the bytes); what that costs against the exact sum of the leaves is at
    most one bfloat16 rounding (2^-8 of the node's magnitude) per level, which
    docs/benchmarks.md measures on a job."""
    rng = np.random.default_rng(shards)
    leaves = [ShardResult(i, round_to(rng.standard_normal(4096).astype(np.float32), "bfloat16"),
                          1.0, 0, 1, np.zeros(2, np.float32)) for i in range(shards)]
    total = reduce_results(leaves, 0, shards, "bfloat16").grad_sum
    assert total.tobytes() == round_to(total, "bfloat16").tobytes()  # it travels as it is
    exact = np.sum([r.grad_sum.astype(np.float64) for r in leaves], axis=0)
    magnitude = np.sum([np.abs(r.grad_sum.astype(np.float64)) for r in leaves], axis=0)
    levels = (shards - 1).bit_length()
    assert (np.abs(total - exact) <= levels * 2.0 ** -8 * magnitude).all()
    float32_total = reduce_results(leaves, 0, shards, "float32").grad_sum
    assert (np.abs(float32_total - exact) <= levels * 2.0 ** -24 * magnitude).all()


@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_the_blocked_tree_sum_of_a_mixed_cover_is_tree_reduce_rounding_every_node(precision):
    """Against `tree.reduce` on whole vectors with the documented add (float32, each node
    rounded to the job's node precision): the blocks' scratch slots, the plan's pairs and the
    rounding at every inner node, not only at the root, for leaves and partials mixed."""
    from engine import tree
    from engine.step import REDUCE_BLOCK

    n, shards = 2 * REDUCE_BLOCK + 77, 13
    rng = np.random.default_rng(13)
    cover = [(0, 4), (4, 5), (5, 6), (6, 8), (8, 9), (9, 10), (10, 11), (11, 12), (12, 13)]
    results = [ShardResult(lo, round_to((rng.standard_normal(n) * 10.0 ** rng.integers(-3, 3, n))
                                        .astype(np.float32), precision),
                           1.0, 0, 1, np.zeros(2, np.float32), hi - lo) for lo, hi in cover]
    want = tree.reduce({r.node: r.grad_sum for r in results}, 0, shards,
                       lambda x, y: round_to(np.add(x, y, dtype=np.float32), precision))
    got = reduce_results(results, 0, shards, precision).grad_sum
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("n", [1, SUM_BLOCK - 1, SUM_BLOCK, 3 * SUM_BLOCK + 17])
def test_ordered_sum_is_the_plain_loop_bit_for_bit(n: int) -> None:
    """The blocked sum must not change one bit against adding whole vectors in order; values of
    wildly different magnitudes make any reordering show (float addition does not associate)."""
    rng = np.random.default_rng(n)
    arrays = [(rng.standard_normal(n) * 10.0 ** rng.integers(-8, 8, n)).astype(np.float32)
              for _ in range(7)]
    plain = np.zeros(n, np.float64)
    for a in arrays:
        plain += a
    assert ordered_sum(arrays, n).tobytes() == plain.tobytes()
    # and it is the order that counts: the reverse order differs somewhere
    if n > 1000:
        backwards = np.zeros(n, np.float64)
        for a in reversed(arrays):
            backwards += a
        assert backwards.tobytes() != plain.tobytes()


@pytest.mark.parametrize("optimizer", [
    {"name": "sgd", "nesterov": True, "weight_decay": 1e-4},
    {"name": "adamw", "weight_decay": 0.05},
    {"name": "lars", "weight_decay": 1e-4},
])
@pytest.mark.parametrize("precision", ["float32", "bfloat16"])
def test_the_tree_sum_made_inside_the_update_pass_is_the_sum_made_first(optimizer, precision):
    """apply_step adds the tree's nodes a range at a time inside the optimizer's pass (and its
    threads): the new state is the one the whole reduced vector would give, bit for bit, on
    any number of threads, for a cover mixing a partial and leaves."""
    from engine.optim import FUSED_BLOCK, Hyper, optimizer_step

    model = build_model("mobilenet_v1", (3, 32, 32), 10, {})
    assert model.n_params > 3 * FUSED_BLOCK  # several blocks, split unevenly over threads
    job = {"model": {"arch": "mobilenet_v1"}, "dataset": "synthetic:3x32x32:10:4096",
           "global_batch_size": 64, "shards": 8, "epochs": 1, "seed": 0,
           "upload_precision": precision, "optimizer": {"lr": 0.1, **optimizer}}
    spec = TrainSpec.from_job_spec(job, n_train=4096)
    rng = np.random.default_rng(7)
    state = initial_state(model, spec)
    state = type(state)(3, state.params, rng.standard_normal(state.opt_state.size)
                        .astype(np.float32) ** 2, state.buffers)  # AdamW's v must be >= 0
    leaves = [ShardResult(k, round_to((rng.standard_normal(model.n_params)
                                       * 10.0 ** rng.integers(-4, 4, model.n_params))
                                      .astype(np.float32), precision),
                          float(k), k, spec.per_shard_batch,
                          rng.standard_normal(model.n_stats).astype(np.float32))
              for k in range(spec.shards)]
    cover = [*pre_reduce(leaves[:4], spec.shards, precision), *leaves[4:]]
    total = reduce_results(cover, 0, spec.shards, precision)
    want_p, want_opt = optimizer_step([total.grad_sum], state.params, state.opt_state,
                                      Hyper.of(spec, state.step), model.decay_mask,
                                      list(model.layout.values()), grad_divisor=total.count)
    for workers in (1, 3):
        after, metrics = apply_step(model, spec, state, cover, workers=workers)
        assert after.params.tobytes() == want_p.tobytes()
        assert after.opt_state.tobytes() == want_opt.tobytes()
        assert metrics.samples == total.count == spec.global_batch_size
