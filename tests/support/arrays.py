"""Named arrays as the .npz bytes the control plane takes and serves (uploads, shard data,
checkpoints): written with numpy, never pickled."""

from __future__ import annotations

import io

import numpy as np


def npz_bytes(compressed: bool = False, **arrays: np.ndarray) -> bytes:
    buf = io.BytesIO()
    (np.savez_compressed if compressed else np.savez)(buf, **arrays)
    return buf.getvalue()
