"""Data augmentation that keeps the math exact: random crop with padding, horizontal flip.

Each sample's crop offsets and flip are drawn from its own stream, seeded by (job seed, step,
shard, the sample's position in the shard), so a sample is augmented the same way whichever
phone computes the shard, and the reference trainer (which computes shards through the same
runner) sees the same images. Crop: zero-pad by p on every side, then take the H x W window at
(dy, dx), each uniform in [0, 2p]; flip: mirror the width axis with probability 1/2. The draws
are always made in that order, whatever is enabled, so turning one on never moves the other.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

AUGMENT_TAG = 0xA06E  # keeps augmentation streams apart from dropout, init and sampler streams


def draws(seed: int, step: int, shard: int, position: int) -> tuple[int, int, bool]:
    """(dy, dx in units of the padding's span, flip) for one sample: offsets are in [0, 2^31)
    and taken modulo 2p + 1 by the caller, so the stream does not depend on p."""
    rng = np.random.default_rng(np.random.SeedSequence([seed, step, shard, position,
                                                        AUGMENT_TAG]))
    dy, dx = (int(v) for v in rng.integers(0, 2**31, size=2))
    return dy, dx, bool(rng.random() < 0.5)


def augment(x: np.ndarray, positions: Sequence[int], seed: int, step: int, shard: int,
            crop_padding: int, horizontal_flip: bool) -> np.ndarray:
    """The micro-batch x (N, C, H, W) augmented; `positions`: each sample's place in its shard."""
    if x.ndim != 4 or not (crop_padding or horizontal_flip):
        return x
    n, c, h, w = x.shape
    p = crop_padding
    padded = np.zeros((n, c, h + 2 * p, w + 2 * p), dtype=x.dtype)
    padded[:, :, p : p + h, p : p + w] = x
    out = np.empty_like(x)
    for i, pos in enumerate(positions):
        dy, dx, flip = draws(seed, step, shard, int(pos))
        dy, dx = (dy % (2 * p + 1), dx % (2 * p + 1)) if p else (0, 0)
        window = padded[i, :, dy : dy + h, dx : dx + w]
        out[i] = window[:, :, ::-1] if horizontal_flip and flip else window
    return out
