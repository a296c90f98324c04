"""Augmentation that keeps the math exact: the same crop and flip for a sample wherever its
shard is computed, drawn from (seed, step, shard, position)."""

from __future__ import annotations

import numpy as np
import pytest

from engine.augment import augment, draws
from engine.runner import job_model, shard_gradient


def _images(n: int = 6) -> np.ndarray:
    return np.arange(n * 2 * 5 * 5, dtype=np.float32).reshape(n, 2, 5, 5) + 1.0


def test_a_crop_is_a_shifted_window_of_the_zero_padded_image():
    x = _images()
    out = augment(x, range(6), 7, 3, 1, crop_padding=2, horizontal_flip=False)
    for i in range(6):
        dy, dx, _ = draws(7, 3, 1, i)
        dy, dx = dy % 5, dx % 5
        padded = np.pad(x[i], ((0, 0), (2, 2), (2, 2)))
        assert np.array_equal(out[i], padded[:, dy : dy + 5, dx : dx + 5])
    assert out.shape == x.shape and not np.array_equal(out, x)


def test_a_flip_mirrors_the_width_of_about_half_the_samples():
    x = _images(200)
    out = augment(x, range(200), 0, 0, 0, crop_padding=0, horizontal_flip=True)
    flipped = [bool(np.array_equal(o, s[:, :, ::-1])) for o, s in zip(out, x)]
    kept = [bool(np.array_equal(o, s)) for o, s in zip(out, x)]
    assert all(f != k for f, k in zip(flipped, kept))
    assert 70 < sum(flipped) < 130
    assert flipped == [draws(0, 0, 0, i)[2] for i in range(200)]


def test_a_sample_is_augmented_by_its_own_seeds_not_by_its_neighbours():
    x = _images()
    whole = augment(x, [10, 11, 12, 13, 14, 15], 1, 2, 3, 2, True)
    alone = augment(x[3:4], [13], 1, 2, 3, 2, True)
    assert np.array_equal(whole[3], alone[0])
    other_step = augment(x, [10, 11, 12, 13, 14, 15], 1, 3, 3, 2, True)
    assert not np.array_equal(whole, other_step)
    assert augment(x, range(6), 1, 2, 3, 0, False) is x  # off: untouched


@pytest.mark.parametrize("aug, differs", [({}, False), ({"crop_padding": 1}, True),
                                          ({"horizontal_flip": True}, True)])
def test_the_runner_augments_the_micro_batch_as_the_spec_asks(aug, differs):
    spec = {"model": {"arch": "mlp", "hidden": 4}, "dataset": "digits", "seed": 2,
            "global_batch_size": 16, "shards": 2, "epochs": 1, "augment": aug}
    plain = job_model({**spec, "augment": {}}, 64, (1, 8, 8), 10)
    job = job_model(spec, 64, (1, 8, 8), 10)
    assert (job.spec.crop_padding, job.spec.horizontal_flip) == (
        aug.get("crop_padding", 0), aug.get("horizontal_flip", False))
    params, buffers = job.model.init(0)
    rng = np.random.default_rng(0)
    x, y = rng.random((32, 1, 8, 8)).astype(np.float32), rng.integers(0, 10, 32)
    a = shard_gradient(job, params, buffers, x, y, 1, 0)
    b = shard_gradient(plain, params, buffers, x, y, 1, 0)
    assert (not np.array_equal(a.grad_sum, b.grad_sum)) is differs
    assert np.array_equal(a.grad_sum, shard_gradient(job, params, buffers, x, y, 1, 0).grad_sum)
