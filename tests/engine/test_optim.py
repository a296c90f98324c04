"""Learning-rate schedules at known steps and the SGD update, by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from engine.optim import lr_at, sgd_update
from engine.spec import SpecError, TrainSpec


def _spec(**opt) -> TrainSpec:
    job = {"model": {"arch": "cnn"}, "dataset": "digits", "global_batch_size": 256,
           "shards": 16, "epochs": 20, "optimizer": {"lr": 0.1, **opt}}
    return TrainSpec.from_job_spec(job, n_train=1438)  # 5 steps per epoch, 100 steps


def test_warmup_then_cosine_at_known_steps():
    s = _spec(warmup_epochs=2, schedule="cosine")
    assert lr_at(s, 0) == pytest.approx(0.1 / 10)
    assert lr_at(s, 9) == pytest.approx(0.1)
    assert lr_at(s, 10) == pytest.approx(0.1)
    assert lr_at(s, 55) == pytest.approx(0.05)  # halfway through the 90 decay steps
    assert lr_at(s, 99) == pytest.approx(0.05 * (1 + math.cos(math.pi * 89 / 90)))


def test_step_schedule_and_constant():
    s = _spec(schedule="step", decay_epochs=[10, 15], decay_factor=0.5)
    assert [lr_at(s, t) for t in (0, 49, 50, 74, 75)] == pytest.approx(
        [0.1, 0.1, 0.05, 0.05, 0.025])
    assert lr_at(_spec(schedule="constant"), 99) == pytest.approx(0.1)


def test_linear_scaling_rule_is_on_by_default_and_switchable():
    job = {"model": {"arch": "cnn"}, "dataset": "digits", "global_batch_size": 512,
           "shards": 16, "epochs": 2, "optimizer": {"lr": 0.1, "schedule": "constant"}}
    assert lr_at(TrainSpec.from_job_spec(job, n_train=1438), 0) == pytest.approx(0.2)
    job["optimizer"]["lr_scaling"] = False
    assert lr_at(TrainSpec.from_job_spec(job, n_train=1438), 0) == pytest.approx(0.1)


def test_sgd_momentum_weight_decay_and_nesterov_by_hand():
    p, v, g = np.array([1.0, 2.0], np.float32), np.array([0.5, 0.0], np.float32), np.array(
        [0.1, -0.2], np.float32)
    mask = np.array([1.0, 0.0], np.float32)  # decay on the first entry only
    new_p, new_v = sgd_update(p, v, g, lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=False,
                              decay_mask=mask)
    want_v = np.array([0.9 * 0.5 + 0.1 + 0.01, -0.2])
    np.testing.assert_allclose(new_v, want_v, rtol=1e-6)
    np.testing.assert_allclose(new_p, p - 0.1 * want_v, rtol=1e-6)
    nes_p, _ = sgd_update(p, v, g, 0.1, 0.9, 0.01, True, mask)
    np.testing.assert_allclose(nes_p, p - 0.1 * (np.array([0.11, -0.2]) + 0.9 * want_v),
                               rtol=1e-6)


@pytest.mark.parametrize("nesterov", [False, True])
def test_blocked_sgd_is_bit_identical_to_the_whole_vector_formula(nesterov):
    # 2.5 blocks: full blocks and a ragged tail; the sum and count as apply_step passes them
    from engine.optim import SGD_BLOCK

    rng = np.random.default_rng(0)
    n = SGD_BLOCK * 5 // 2
    p, v = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    grad_sum = rng.standard_normal(n) * 37.0
    mask = (rng.random(n) > 0.3).astype(np.float32)
    lr, mom, wd, count = 0.05, 0.9, 1e-4, 96
    g = (grad_sum / count).astype(np.float64)
    g += wd * mask * p.astype(np.float64)
    want_v = mom * v.astype(np.float64) + g
    want_p = (p.astype(np.float64) - lr * (g + mom * want_v if nesterov else want_v))
    new_p, new_v = sgd_update(p, v, grad_sum, lr, mom, wd, nesterov, mask, grad_divisor=count)
    assert new_p.dtype == new_v.dtype == np.float32
    assert np.array_equal(new_p, want_p.astype(np.float32))
    assert np.array_equal(new_v, want_v.astype(np.float32))


def test_schedule_needs_the_dataset_size():
    s = TrainSpec.from_job_spec({"model": {"arch": "cnn"}, "dataset": "digits"})
    with pytest.raises(SpecError, match="n_train"):
        lr_at(s, 0)


@pytest.mark.parametrize(("change", "needle"), [
    ({"global_batch_size": 250}, "multiple of shards"),
    ({"optimizer": {"schedule": "linear"}}, "optimizer.schedule"),
    ({"optimizer": {"warmup_epochs": 30}}, "warmup_epochs"),
    ({"shards": 2048, "global_batch_size": 2048}, "exceeds the dataset"),
    ({"shards": 16, "global_batch_size": 2048}, "fewer than the 128 per-shard batch"),
    ({"model": {}}, "model.arch"),
])
def test_bad_specs_are_refused_naming_the_field(change, needle):
    job = {"model": {"arch": "cnn"}, "dataset": "digits", "epochs": 20, **change}
    with pytest.raises(SpecError, match=needle):
        TrainSpec.from_job_spec(job, n_train=1438)


@pytest.mark.parametrize(("change", "needle"), [
    ({"epochs": "ten"}, "epochs must be an integer, got 'ten'"),
    ({"epochs": 2.5}, "epochs must be an integer"),
    ({"optimizer": {"lr": True}}, "optimizer.lr must be a number"),
    ({"optimizer": {"nesterov": "yes"}}, "optimizer.nesterov must be true or false"),
    ({"model": {"arch": "cnn", "width": "wide"}}, "model.width must be a number"),
    ({"optimizer": {"decay_epochs": 5}}, "decay_epochs must be a list"),
])
def test_wrongly_typed_fields_are_refused_by_name(change, needle):
    job = {"model": {"arch": "cnn"}, "dataset": "digits", **change}
    with pytest.raises(SpecError, match=needle):
        TrainSpec.from_job_spec(job)


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize(("nesterov", "wd"), [(False, 1e-4), (True, 0.0)])
def test_fused_sum_and_update_is_bit_identical_to_sum_then_update(workers, nesterov, wd):
    """apply_step's one-pass sum + update, on any number of threads, changes no bit against
    the shard-order float64 sum followed by the SGD update (the sum's order itself is pinned
    by test_step's ordered_sum test)."""
    from engine.optim import FUSED_BLOCK, sum_and_update
    from engine.step import ordered_sum

    rng = np.random.default_rng(workers)
    n = FUSED_BLOCK * 5 + 123  # ragged tail; ranges split unevenly between the threads
    grads = [(rng.standard_normal(n) * 10.0 ** rng.integers(-8, 8, n)).astype(np.float32)
             for _ in range(6)]
    p, v = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    mask = (rng.random(n) > 0.3).astype(np.float32)
    want_p, want_v = sgd_update(p, v, ordered_sum(grads, n), 0.05, 0.9, wd, nesterov, mask,
                                grad_divisor=96)
    got_p, got_v = sum_and_update(grads, p, v, 0.05, 0.9, wd, nesterov, mask, grad_divisor=96,
                                  workers=workers)
    assert got_p.tobytes() == want_p.tobytes() and got_v.tobytes() == want_v.tobytes()
