"""The optimizer's smaller rules, by hand (issue 44 item 3, what `scripts/mutation optim`
found untested): a step's settings read from the spec, the schedule's ends (a fractional warmup,
a step past the last), the defaults of the fused update, and the thread pools made once."""

from __future__ import annotations

import math

import numpy as np
import pytest

from engine.base import Slot
from engine.optim import (
    STATE_SLOTS,
    Hyper,
    _pool,
    lr_at,
    optimizer_step,
    ordered_sum,
    sgd_update,
    sum_and_update,
)
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


# -- each optimizer against its formula in float64 (the second mutation run's survivors) -------

N = 40
# four tensors: a kernel of zeros (|w| = 0: no trust ratio), a kernel whose gradient is zero
# (|g| = 0: none either), a kernel of small weights and tiny gradients (|w| < 1, and eps
# weighs in the trust ratio), and a bias (no decay)
SLOTS = [Slot("zero_w", 0, (10,), decay=True), Slot("zero_g", 10, (10,), decay=True),
         Slot("small", 20, (10,), decay=True), Slot("bias", 30, (10,))]


def _case(seed: int = 5) -> tuple[list[np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    grads = [rng.standard_normal(N).astype(np.float32) for _ in range(3)]
    for g in grads:
        g[10:20] = 0.0
        g[20:30] *= 1e-7
    params = rng.standard_normal(N).astype(np.float32)
    params[0:10] = 0.0
    params[20:30] *= 0.01
    mask = np.array([1.0 if s.decay else 0.0 for s in SLOTS for _ in range(s.size)], np.float32)
    return grads, params, mask, rng.standard_normal(2 * N).astype(np.float32)


def _formula(kind: str, grads: list[np.ndarray], params: np.ndarray, state: np.ndarray,
             hp: Hyper, mask: np.ndarray, divisor: float) -> tuple[np.ndarray, np.ndarray]:
    """docs/training.md's update of each optimizer, written plainly in float64."""
    g = np.sum([x.astype(np.float64) for x in grads], axis=0) / divisor
    p, m64 = params.astype(np.float64), mask.astype(np.float64)
    if kind == "sgd" or kind == "lars":
        d = g + hp.weight_decay * m64 * p
        if kind == "lars":
            for s in SLOTS:
                part = slice(s.offset, s.offset + s.size)
                w, gn = np.linalg.norm(p[part]), np.linalg.norm(g[part])
                if s.decay and w > 0 and gn > 0:
                    d[part] *= hp.trust_coefficient * w / (gn + hp.weight_decay * w + hp.eps)
        v = hp.momentum * state[:N].astype(np.float64) + d
        step = d + hp.momentum * v if hp.nesterov else v
        return p - hp.lr * step, v
    b1, b2 = hp.betas
    p = p * (1.0 - hp.lr * hp.weight_decay * m64)
    m = b1 * state[:N].astype(np.float64) + (1 - b1) * g
    v = b2 * state[N:].astype(np.float64) + (1 - b2) * g * g
    denom = np.sqrt(v) / math.sqrt(1 - b2 ** hp.t) + hp.eps
    return p - hp.lr / (1 - b1 ** hp.t) * m / denom, np.concatenate([m, v])


@pytest.mark.parametrize("kind", ["sgd", "adamw", "lars"])
@pytest.mark.parametrize("divisor", [2.0, 48.0])
@pytest.mark.parametrize("nesterov", [False, True])
def test_each_optimizer_is_its_formula_on_the_sum_over_the_divisor(kind, divisor, nesterov) -> None:
    # eps 0.05 for AdamW: its update is otherwise nearly blind to the gradient's scale
    hp = Hyper(kind, 0.1, 3, momentum=0.9, weight_decay=5e-4, nesterov=nesterov,
               eps=0.05 if kind == "adamw" else 1e-8, trust_coefficient=0.02)
    grads, params, mask, state = _case()
    state = state[:len(STATE_SLOTS[kind]) * N]
    if kind == "adamw":
        state[N:] = np.abs(state[N:])  # a second moment is never negative
    got_p, got_s = optimizer_step(grads, params, state, hp, mask, SLOTS, grad_divisor=divisor)
    want_p, want_s = _formula(kind, grads, params, state, hp, mask, divisor)
    assert got_p.dtype == got_s.dtype == np.float32  # what the weights message carries
    np.testing.assert_allclose(got_p, want_p, rtol=2e-7, atol=1e-12)
    np.testing.assert_allclose(got_s, want_s, rtol=2e-7, atol=1e-12)
    if kind == "lars":  # the zero kernel and the zero gradient's kernel: no trust ratio
        d = hp.weight_decay * params[10:20].astype(np.float64)
        np.testing.assert_allclose(got_s[10:20], 0.9 * state[10:20] + d, rtol=2e-7)


@pytest.mark.parametrize("kind", ["sgd", "adamw", "lars"])
def test_a_step_without_results_updates_from_a_zero_gradient(kind) -> None:
    hp = Hyper(kind, 0.1, 3, weight_decay=5e-4, trust_coefficient=0.02)
    _, params, mask, state = _case()
    state = np.abs(state[:len(STATE_SLOTS[kind]) * N])
    seen: list[slice] = []
    got_p, got_s = optimizer_step([], params, state, hp, mask, SLOTS, done=seen.append)
    want_p, want_s = _formula(kind, [np.zeros(N, np.float32)], params, state, hp, mask, 1.0)
    np.testing.assert_allclose(got_p, want_p, rtol=2e-7, atol=1e-12)
    np.testing.assert_allclose(got_s, want_s, rtol=2e-7, atol=1e-12)
    assert sorted(i for b in seen for i in range(*b.indices(N))) == list(range(N))


def test_without_a_divisor_the_sum_is_the_gradient() -> None:
    grads, params, mask, state = _case()
    hp = Hyper("sgd", 0.1, 1, weight_decay=5e-4)
    plain = optimizer_step(grads, params, state[:N], hp, mask, SLOTS)
    ones = optimizer_step(grads, params, state[:N], hp, mask, SLOTS, grad_divisor=1.0)
    assert plain[0].tobytes() == ones[0].tobytes() and plain[1].tobytes() == ones[1].tobytes()


def test_a_wrong_state_or_optimizer_is_refused_saying_what_it_holds() -> None:
    grads, params, mask, state = _case()
    with pytest.raises(ValueError) as wrong:
        optimizer_step(grads, params, state, Hyper("sgd", 0.1, 1), mask, SLOTS)
    assert str(wrong.value) == ("sgd keeps 1 vector(s) of state per parameter; "
                                "the state holds 2")
    with pytest.raises(ValueError) as wrong:
        optimizer_step(grads, params, state, Hyper("rmsprop", 0.1, 1), mask, SLOTS)
    assert str(wrong.value) == "unknown optimizer 'rmsprop'; one of sgd, adamw, lars"
