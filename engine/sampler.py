"""The shard sampler: which samples every shard contributes to every step.

Definition (the unit of data is the shard, so placement cannot change it; docs/engine.md, "The
sampler (definition)"):

* The training set (n samples) is split into S shards by one seeded permutation of [0, n),
  ``permute(n, (seed, SHARD_TAG), i)`` (below); shard k is positions ``[lo_k, hi_k)`` of it,
  where the first ``n % S`` shards hold ``n // S + 1`` samples and the rest ``n // S`` (as
  ``np.array_split`` cuts), so shard sizes differ by at most one.
* Every step takes m = B / S samples from every shard. In epoch e shard k walks its own
  permutation ``rng(seed, e, k).permutation(len(shard_k))``; step t (epoch e = t // spe,
  position j = t % spe) takes positions ``[j*m, (j+1)*m)`` of that permutation.
* ``steps_per_epoch = floor(min shard size / m)`` (drop-last: the few samples of a shard left
  after the last full micro-batch are skipped that epoch; the next epoch's permutation differs,
  so no sample is skipped for good). ``total_steps = epochs * steps_per_epoch``.

``permute`` computes any positions of its permutation one index at a time (a Feistel network
with cycle walking, integer arithmetic only), so the control plane builds a chunk of shard k
in memory proportional to the chunk, never to n: the whole permutation is never made.

Everything here is a pure function of its integer arguments, the same on every CPU.
"""

from __future__ import annotations

import numpy as np

SHARD_TAG = 0x5A4D  # keeps the shard-split permutation apart from every other seeded stream


def _rng(*words: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([int(w) for w in words]))


# -- permute: one index at a time --------------------------------------------------------------

FEISTEL_ROUNDS = 6
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_M1, _M2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_BLOCK = 1 << 16  # positions permuted at once: the temporaries stay O(block)


def _mix64(z: int) -> int:
    """splitmix64's finalizer on a Python integer below 2^64."""
    z = ((z ^ (z >> 30)) * _M1) & _MASK64
    z = ((z ^ (z >> 27)) * _M2) & _MASK64
    return z ^ (z >> 31)


def feistel_keys(words: tuple[int, ...] | list[int]) -> list[int]:
    """The round keys of the permutation seeded by `words` (each taken modulo 2^64): the
    words folded by splitmix64 (``z = mix(z + GOLDEN + w)`` from ``z = len(words)``), then
    one splitmix64 output per round (``z += GOLDEN; key = mix(z)``)."""
    z = len(words)
    for w in words:
        z = _mix64((z + _GOLDEN + (int(w) & _MASK64)) & _MASK64)
    keys = []
    for _ in range(FEISTEL_ROUNDS):
        z = (z + _GOLDEN) & _MASK64
        keys.append(_mix64(z))
    return keys


def _bits(n: int) -> int:
    """b: the permutation runs over [0, 2^b), the smallest such range holding [0, n) (b >= 2)."""
    return max(2, (n - 1).bit_length())


def _mix_array(z: np.ndarray) -> np.ndarray:
    z = z ^ (z >> np.uint64(30))
    z *= np.uint64(_M1)  # uint64 arrays wrap modulo 2^64, silently
    z ^= z >> np.uint64(27)
    z *= np.uint64(_M2)
    z ^= z >> np.uint64(31)
    return z


def _encrypt(v: np.ndarray, keys: list[int], b: int) -> np.ndarray:
    """One pass of the Feistel network over b-bit values (uint64 in, uint64 out), a = ceil(b/2)
    and c = b - a: each round ``hi, lo = v >> c, v & (2^c - 1)`` and
    ``v = (lo << a) | (hi ^ (mix(lo ^ key) >> (64 - a)))``. Each round is a bijection of
    [0, 2^b) (lo and then hi are read back from the result), so the pass is one for any keys."""
    a, c = (b + 1) // 2, b // 2
    sa, sc, top, low = np.uint64(a), np.uint64(c), np.uint64(64 - a), np.uint64((1 << c) - 1)
    for key in keys:
        lo = v & low
        v = (lo << sa) | ((v >> sc) ^ (_mix_array(lo ^ np.uint64(key)) >> top))
    return v


def permute(n: int, words: tuple[int, ...] | list[int], positions: np.ndarray | range
            ) -> np.ndarray:
    """Entries `positions` of the seeded permutation of [0, n) (int64): position i maps to
    ``E(i)``, or ``E(E(i))``, ... the first that is below n (cycle walking), where E is
    `_encrypt` over [0, 2^b) with the round keys of `words` (2^b < 2n, so a position takes
    under two passes on average). Costs memory in proportion to len(positions), not n."""
    n = int(n)
    pos = np.asarray(positions, dtype=np.int64).reshape(-1)
    if n < 1:
        raise ValueError(f"a permutation of {n} elements")
    if len(pos) and (pos.min() < 0 or pos.max() >= n):
        raise IndexError(f"positions {pos.min()}..{pos.max()} of a permutation of {n}")
    keys, b = feistel_keys(words), _bits(n)
    out = np.empty(len(pos), np.int64)
    for start in range(0, len(pos), _BLOCK):
        v = _encrypt(pos[start : start + _BLOCK].astype(np.uint64), keys, b)
        walk = np.flatnonzero(v >= np.uint64(n))
        while len(walk):  # a cycle of E always comes back below n: this ends
            v[walk] = _encrypt(v[walk], keys, b)
            walk = walk[v[walk] >= np.uint64(n)]
        out[start : start + len(v)] = v.view(np.int64)
    return out


# -- shards --------------------------------------------------------------------------------------

def _check_shards(n_train: int, shards: int) -> None:
    if not 1 <= shards <= n_train:
        raise ValueError(f"shards ({shards}) must be between 1 and the {n_train} training samples")


def shard_bounds(n_train: int, shards: int, shard: int) -> tuple[int, int]:
    """[lo, hi): shard `shard`'s positions in the shard-split permutation (np.array_split's
    cut: the first n % S shards one longer)."""
    _check_shards(n_train, shards)
    if not 0 <= shard < shards:
        raise ValueError(f"shard {shard} of {shards}")
    q, r = divmod(int(n_train), int(shards))
    lo = shard * q + min(shard, r)
    return lo, lo + q + (1 if shard < r else 0)


def shard_length(n_train: int, shards: int, shard: int) -> int:
    lo, hi = shard_bounds(n_train, shards, shard)
    return hi - lo


def shard_samples(n_train: int, shards: int, seed: int, shard: int, start: int = 0,
                  stop: int | None = None) -> np.ndarray:
    """Training-set indices (int64) of shard `shard`'s samples `start..stop` in the order the
    control plane serves them: memory in proportion to stop - start."""
    lo, hi = shard_bounds(n_train, shards, shard)
    size = hi - lo
    stop = size if stop is None else min(int(stop), size)
    start = min(max(0, int(start)), stop)
    return permute(n_train, (seed, SHARD_TAG), np.arange(lo + start, lo + stop, dtype=np.int64))


def shard_indices(n_train: int, shards: int, seed: int) -> list[np.ndarray]:
    """Every shard's training-set indices (int64 arrays): the whole split, n integers (the
    reference trainer and tests; the control plane asks `shard_samples` a chunk at a time)."""
    _check_shards(n_train, shards)
    whole = permute(n_train, (seed, SHARD_TAG), np.arange(n_train, dtype=np.int64))
    return [whole[slice(*shard_bounds(n_train, shards, k))] for k in range(shards)]


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
