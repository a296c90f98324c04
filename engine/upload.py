"""Validation of an uploaded dataset (.npz with `x`, `y`, optionally `x_val`, `y_val`, `mean`,
`std`): the rules live in engine/stored.py, which keeps uploads on disk.

Loaded with allow_pickle=False only. Accepted: x float16/32/64 or uint8 (scaled by 1/255) of
shape (N, C, H, W), (N, H, W) -> (N, 1, H, W) or (N, F) -> (N, F, 1, 1), all finite; y integer
of shape (N,) with labels 0..K-1, K >= 2. `mean` and `std` (C values each, std > 0): every
sample is normalized per channel, x = (x - mean) / std, after the uint8 scaling (`phalanx
datasets import` writes them from the training images). `max_bytes` bounds both the file and
the arrays it unpacks to. Without x_val/y_val a fixed seeded 20% of the samples becomes the
validation split.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from engine.dataset import Dataset, DatasetError
from engine.stored import check_folder, unpack_npz


def validate_file(source: Path, dest: Path, max_bytes: int) -> Dataset:
    """Unpack the .npz at `source` into the folder `dest` and check it: the dataset (its
    features read from `dest` when used), or DatasetError naming what is wrong."""
    size = source.stat().st_size
    if size > max_bytes:
        raise DatasetError(f"file is {size} bytes, over the limit of {max_bytes}")
    unpack_npz(source, dest, max_bytes)
    return check_folder(dest)


def validate_npz(data: bytes, max_bytes: int) -> Dataset:
    """The dataset in `data`, in memory (small files: tests, the reference trainer's checks)."""
    if len(data) > max_bytes:
        raise DatasetError(f"file is {len(data)} bytes, over the limit of {max_bytes}")
    with tempfile.TemporaryDirectory(prefix="phalanx-npz-") as tmp:
        source = Path(tmp) / "upload.npz"
        source.write_bytes(data)
        ds = validate_file(source, Path(tmp) / "arrays", max_bytes)
        return Dataset(np.asarray(ds.x_train), np.asarray(ds.y_train), np.asarray(ds.x_val),
                       np.asarray(ds.y_val), ds.input_shape, ds.num_classes, ds.name)
