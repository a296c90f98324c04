"""Learning-rate schedules at known steps and the SGD update, by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from engine.optim import lr_at, sgd_update
from engine.spec import SpecError, TrainSpec
from tests.support.optional import require


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
@pytest.mark.parametrize("wide", ["mask", "weight_decay", None])
def test_blocked_sgd_is_bit_identical_to_the_whole_vector_formula(nesterov, wide):
    # 2.5 blocks: full blocks and a ragged tail; the sum and count as apply_step passes them
    from engine.optim import SGD_BLOCK

    rng = np.random.default_rng(0)
    n = SGD_BLOCK * 5 // 2
    p, v = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    grad_sum = rng.standard_normal(n) * 37.0
    mask = (rng.random(n) > 0.3).astype(np.float64 if wide == "mask" else np.float32)
    lr, mom, wd, count = 0.05, 0.9, 1e-4, 96
    if wide == "weight_decay":  # a numpy float64 promotes `wd * mask` to float64
        wd = np.float64(wd)
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
    from engine.optim import FUSED_BLOCK, ordered_sum, sum_and_update

    rng = np.random.default_rng(workers)
    n = FUSED_BLOCK * 5 + 123  # ragged tail; ranges split unevenly between the threads
    grads = [(rng.standard_normal(n) * 10.0 ** rng.integers(-8, 8, n)).astype(np.float32)
             for _ in range(6)]
    p, v = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    mask = (rng.random(n) > 0.3).astype(np.float32)
    # the sum starts at +0.0: six -0.0s add up to +0.0, and a -0.0 momentum shows the sign
    for g in grads:
        g[:50] = -0.0
    p[:50], v[:50] = 0.0, -0.0
    want_p, want_v = sgd_update(p, v, ordered_sum(grads, n), 0.05, 0.9, wd, nesterov, mask,
                                grad_divisor=96)
    got_p, got_v = sum_and_update(grads, p, v, 0.05, 0.9, wd, nesterov, mask, grad_divisor=96,
                                  workers=workers)
    assert got_p.tobytes() == want_p.tobytes() and got_v.tobytes() == want_v.tobytes()


@pytest.mark.parametrize("kind", ["sgd", "adamw", "lars"])
@pytest.mark.parametrize("workers", [1, 3])
def test_done_is_told_of_every_element_once_after_it_is_final(kind, workers):
    """apply_step's caller copies and checksums each block of the new weights as `done`
    tells it (scheduler.tasks.steps): every element once, each block already written."""
    from engine.base import Slot
    from engine.optim import FUSED_BLOCK, STATE_SLOTS, Hyper, optimizer_step

    n = FUSED_BLOCK * 3 + 123
    rng = np.random.default_rng(5)
    grads = [rng.standard_normal(n).astype(np.float32) for _ in range(2)]
    p, state = rng.standard_normal(n).astype(np.float32), np.zeros(
        len(STATE_SLOTS[kind]) * n, np.float32)
    slots = [Slot("w", 0, (n,), decay=True)]  # LARS scales whole tensors: one here
    new_p = np.full(n, np.nan, np.float32)
    seen = np.zeros(n, np.int64)
    final: list[bool] = []

    def done(block: slice) -> None:
        seen[block] += 1
        final.append(not np.isnan(new_p[block]).any())

    want, _ = optimizer_step(grads, p, state, Hyper(kind, 0.01, 1), np.ones(n, np.float32),
                             slots, grad_divisor=8.0)
    got, _ = optimizer_step(grads, p, state, Hyper(kind, 0.01, 1), np.ones(n, np.float32),
                            slots, grad_divisor=8.0, workers=workers,
                            out=(new_p, np.empty_like(state)), done=done)
    assert (seen == 1).all() and all(final)
    assert got.tobytes() == want.tobytes()


# -- AdamW and LARS against PyTorch, label smoothing against torch's cross entropy -------------

def _model_and_grads(steps: int = 4, seed: int = 0):
    from engine.models import build_model

    model = build_model("cnn", (1, 8, 8), 10, {"width": 0.25})
    params, _ = model.init(seed)
    rng = np.random.default_rng(seed)
    # each step's gradient as three shards' sums and the sample count that divides them
    grads = [[rng.standard_normal(model.n_params).astype(np.float32) for _ in range(3)]
             for _ in range(steps)]
    return model, params, grads


def _ours(kind: str, model, params, grads, lrs, **hyper):
    from engine.optim import STATE_SLOTS, Hyper, optimizer_step

    state = np.zeros(len(STATE_SLOTS[kind]) * params.size, np.float32)
    p = params
    for t, (shards, lr) in enumerate(zip(grads, lrs)):
        p, state = optimizer_step(shards, p, state, Hyper(kind, lr, t + 1, **hyper),
                                  model.decay_mask, list(model.layout.values()),
                                  grad_divisor=48.0)
    return p


def _torch_params(torch, model, params):
    """One float64 tensor per layout slot, grouped as our decay mask groups them."""
    tensors = {name: torch.tensor(s.view(params).astype(np.float64), requires_grad=True)
               for name, s in model.layout.items()}
    decay = [tensors[n] for n, s in model.layout.items() if s.decay]
    rest = [tensors[n] for n, s in model.layout.items() if not s.decay]
    return tensors, decay, rest


def _set_grads(torch, model, tensors, shards):
    total = np.zeros(model.n_params, np.float64)
    for g in shards:
        total += g
    total /= 48.0
    for name, s in model.layout.items():
        tensors[name].grad = torch.tensor(s.view(total).copy())


def _flat(model, tensors) -> np.ndarray:
    return np.concatenate([tensors[n].detach().numpy().ravel() for n in model.layout])


def test_adamw_equals_torch_adamw_for_a_few_steps_on_the_same_gradients():
    torch = require("torch")
    model, params, grads = _model_and_grads()
    lrs = [1e-3, 2e-3, 3e-3, 2.5e-3]
    ours = _ours("adamw", model, params, grads, lrs, weight_decay=0.05, betas=(0.9, 0.95),
                 eps=1e-8)
    tensors, decay, rest = _torch_params(torch, model, params)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05},
                             {"params": rest, "weight_decay": 0.0}], betas=(0.9, 0.95), eps=1e-8)
    for shards, lr in zip(grads, lrs):
        for group in opt.param_groups:
            group["lr"] = lr
        _set_grads(torch, model, tensors, shards)
        opt.step()
    theirs = _flat(model, tensors)
    assert not np.allclose(theirs, params)  # it moved
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-7)


def _lars_reference(torch, model, params, grads, lrs, wd, eta, momentum):
    """LARS as NVIDIA apex's LARC (clip=False) wraps torch.optim.SGD: each kernel's gradient
    plus weight decay, scaled by eta |w| / (|g| + wd |w| + eps); biases and BN untouched."""
    tensors, decay, rest = _torch_params(torch, model, params)
    opt = torch.optim.SGD(decay + rest, lr=lrs[0], momentum=momentum, weight_decay=0.0)
    for shards, lr in zip(grads, lrs):
        opt.param_groups[0]["lr"] = lr
        _set_grads(torch, model, tensors, shards)
        with torch.no_grad():
            for p in decay:
                w_norm, g_norm = torch.norm(p), torch.norm(p.grad)
                trust = eta * w_norm / (g_norm + wd * w_norm + 1e-8)
                p.grad.add_(p, alpha=wd).mul_(trust)
        opt.step()
    return _flat(model, tensors)


def test_lars_equals_the_layer_wise_rule_on_torch_sgd():
    torch = require("torch")
    model, params, grads = _model_and_grads()
    lrs = [0.5, 1.0, 2.0, 1.5]
    ours = _ours("lars", model, params, grads, lrs, weight_decay=5e-4, momentum=0.9,
                 trust_coefficient=0.02)
    theirs = _lars_reference(torch, model, params, grads, lrs, 5e-4, 0.02, 0.9)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-7)
    # the trust ratio is per tensor: scaling one kernel's gradient leaves its own step alone
    # (|g| cancels) but changes nothing elsewhere either
    scaled = [[g.copy() for g in shards] for shards in grads]
    s = model.layout["conv1.weight"]
    for shards in scaled:
        for g in shards:
            g[s.offset : s.offset + s.size] *= 10
    again = _ours("lars", model, params, scaled, lrs, weight_decay=0.0, momentum=0.9,
                  trust_coefficient=0.02)
    plain = _ours("lars", model, params, grads, lrs, weight_decay=0.0, momentum=0.9,
                  trust_coefficient=0.02)
    # atol: an element that momentum and decay bring near 0 keeps the absolute error only
    np.testing.assert_allclose(s.view(again), s.view(plain), rtol=1e-5, atol=1e-8)
    others = np.ones(model.n_params, bool)
    others[s.offset : s.offset + s.size] = False
    assert np.array_equal(again[others], plain[others])  # per tensor: nothing else moved


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.3])
def test_label_smoothing_equals_torch_cross_entropy(smoothing):
    torch = require("torch")
    from engine.layers import softmax_cross_entropy

    rng = np.random.default_rng(1)
    logits, y = rng.standard_normal((7, 5)) * 3, rng.integers(0, 5, 7)
    loss, _, grad = softmax_cross_entropy(logits, y, smoothing)
    lt = torch.tensor(logits, requires_grad=True)
    ref = torch.nn.functional.cross_entropy(lt, torch.tensor(y), reduction="sum",
                                            label_smoothing=smoothing)
    ref.backward()
    assert loss == pytest.approx(ref.item(), rel=1e-12)
    np.testing.assert_allclose(grad, lt.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_the_optimizer_and_its_settings_are_read_and_checked():
    s = _spec(type="adamw", beta1=0.8, beta2=0.99, eps=1e-6)
    assert (s.optimizer, s.beta1, s.beta2, s.eps) == ("adamw", 0.8, 0.99, 1e-6)
    with pytest.raises(SpecError, match="optimizer.type must be one of sgd, adamw, lars"):
        _spec(type="adam")
    with pytest.raises(SpecError, match="beta1 and optimizer.beta2 must be in"):
        _spec(type="adamw", beta2=1.0)


def test_an_adamw_checkpoint_keeps_both_moments_under_torchs_names():
    from engine.checkpoint import load_npz, save_npz, state_from_arrays, state_to_arrays
    from engine.step import TrainState

    model, params, _ = _model_and_grads(steps=0)
    rng = np.random.default_rng(3)
    state = TrainState(5, params, rng.standard_normal(2 * model.n_params).astype(np.float32),
                       np.zeros(model.n_buffers, np.float32))
    arrays = load_npz(save_npz(state_to_arrays(model, state)))
    assert "exp_avg/conv1.weight" in arrays and "exp_avg_sq/fc2.bias" in arrays
    back = state_from_arrays(model, arrays)
    assert back.step == 5 and np.array_equal(back.opt_state, state.opt_state)
