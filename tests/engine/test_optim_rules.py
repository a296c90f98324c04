"""The optimizer's smaller rules, by hand (issue 44 item 3, what `scripts/mutation optim`
found untested): a step's settings read from the spec, the schedule's ends (a fractional warmup,
a step past the last), the defaults of the fused update, and the thread pools made once."""

from __future__ import annotations

import math

import numpy as np
import pytest

from engine.optim import Hyper, _pool, lr_at, ordered_sum, sgd_update, sum_and_update
from engine.spec import TrainSpec


def _spec(epochs: int = 20, **opt) -> TrainSpec:
    job = {"model": {"arch": "cnn"}, "dataset": "digits", "global_batch_size": 256,
           "shards": 16, "epochs": epochs, "optimizer": {"lr": 0.1, **opt}}
    return TrainSpec.from_job_spec(job, n_train=1438)  # 5 steps per epoch


def test_a_step_s_settings_come_from_the_spec_and_its_number_is_one_based() -> None:
    spec = _spec(type="adamw", momentum=0.8, weight_decay=0.05, nesterov=True, beta1=0.8, beta2=0.95,
                 eps=1e-6, trust_coefficient=0.02, schedule="constant")
    assert Hyper.of(spec, 7) == Hyper("adamw", lr_at(spec, 7), 8, 0.8, 0.05, True, (0.8, 0.95),
                                      1e-6, 0.02)
    warm = _spec(warmup_epochs=2)
    assert Hyper.of(warm, 3).lr == pytest.approx(0.1 * 4 / 10) and Hyper.of(warm, 3).t == 4


def test_a_cosine_after_a_fractional_warmup_decays_over_what_is_left() -> None:
    """20 epochs of 5 steps, warmup 19.7 epochs = 98.5 steps: the cosine spans 1.5 steps."""
    spec = _spec(warmup_epochs=19.7, schedule="cosine")
    assert lr_at(spec, 99) == pytest.approx(0.05 * (1 + math.cos(math.pi * 0.5 / 1.5)))


def test_past_its_last_step_the_cosine_stays_at_zero() -> None:
    spec = _spec(schedule="cosine")
    assert lr_at(spec, 100) == pytest.approx(0.0, abs=1e-12)
    assert lr_at(spec, 150) == pytest.approx(0.0, abs=1e-12)


def test_the_fused_update_s_defaults_divide_by_one_on_one_thread() -> None:
    rng = np.random.default_rng(3)
    grads = [rng.standard_normal(100).astype(np.float32) for _ in range(3)]
    p, v = rng.standard_normal(100).astype(np.float32), rng.standard_normal(100).astype(np.float32)
    mask = np.ones(100, np.float32)
    want = sgd_update(p, v, ordered_sum(grads, 100), 0.1, 0.9, 0.0, False, mask)
    got = sum_and_update(grads, p, v, 0.1, 0.9, 0.0, False, mask)
    assert got[0].tobytes() == want[0].tobytes() and got[1].tobytes() == want[1].tobytes()


def test_the_update_s_threads_are_made_once_per_count() -> None:
    assert _pool(2) is _pool(2) and _pool(3) is not _pool(2)
