"""The shard sampler: which samples every shard contributes to every step.

Definition (the unit of data is the shard, so placement cannot change it):

* The training set (n samples) is split into S shards by one seeded permutation:
  ``perm = rng(seed, "shards").permutation(n)``; shard k is ``np.array_split(perm, S)[k]``,
  so shard sizes differ by at most one.
* Every step takes m = B / S samples from every shard. In epoch e shard k walks its own
  permutation ``rng(seed, e, k).permutation(len(shard_k))``; step t (epoch e = t // spe,
  position j = t % spe) takes positions ``[j*m, (j+1)*m)`` of that permutation.
* ``steps_per_epoch = floor(min shard size / m)`` (drop-last: the few samples of a shard left
  after the last full micro-batch are skipped that epoch; the next epoch's permutation differs,
  so no sample is skipped for good). ``total_steps = epochs * steps_per_epoch``.

Everything here is a pure function of its integer arguments.
"""

from __future__ import annotations

import numpy as np

_SHARD_TAG = 0x5A4D  # keeps the shard-split stream apart from the per-epoch streams


def _rng(*words: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(w) for w in words]))


def shard_indices(n_train: int, shards: int, seed: int) -> list[np.ndarray]:
    """Global sample indices of each shard (int64 arrays), from one seeded permutation."""
    if not 1 <= shards <= n_train:
        raise ValueError(f"shards ({shards}) must be between 1 and the {n_train} training samples")
    perm = _rng(seed, _SHARD_TAG).permutation(n_train)
    return [part.astype(np.int64) for part in np.array_split(perm, shards)]


def steps_per_epoch(n_train: int, shards: int, global_batch_size: int) -> int:
    """Full micro-batches the smallest shard holds (drop-last)."""
    if global_batch_size % shards:
        raise ValueError(
            f"global_batch_size ({global_batch_size}) must be divisible by shards ({shards})"
        )
    per_shard = global_batch_size // shards
    smallest = n_train // shards
    if per_shard < 1 or smallest < per_shard:
        raise ValueError(
            f"each shard holds {smallest} samples, fewer than the {per_shard} per-shard batch "
            f"(global_batch_size / shards): lower global_batch_size or shards"
        )
    return smallest // per_shard


def total_steps(n_train: int, shards: int, global_batch_size: int, epochs: int) -> int:
    return epochs * steps_per_epoch(n_train, shards, global_batch_size)


def microbatch(
    shard_size: int, per_shard_batch: int, seed: int, step: int, shard: int, steps_per_epoch: int
) -> np.ndarray:
    """Positions (into the shard's own sample order) of shard `shard`'s micro-batch at `step`."""
    if steps_per_epoch < 1 or per_shard_batch * steps_per_epoch > shard_size:
        raise ValueError(
            f"{steps_per_epoch} steps of {per_shard_batch} do not fit a shard of {shard_size}"
        )
    epoch, j = divmod(int(step), int(steps_per_epoch))
    perm = _rng(seed, epoch, shard).permutation(shard_size)
    return perm[j * per_shard_batch : (j + 1) * per_shard_batch].astype(np.int64)


def select_microbatch(
    x_shard: np.ndarray, y_shard: np.ndarray, per_shard_batch: int, seed: int, step: int,
    shard: int, steps_per_epoch: int,
) -> tuple[np.ndarray, np.ndarray]:
    """The step's micro-batch arrays out of a shard's data (as served in shard order)."""
    pos = microbatch(len(x_shard), per_shard_batch, seed, step, shard, steps_per_epoch)
    return x_shard[pos], y_shard[pos]
