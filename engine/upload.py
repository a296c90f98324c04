"""Validation of an uploaded dataset (.npz with `x`, `y`, optionally `x_val`, `y_val`, `mean`,
`std`).

Loaded with allow_pickle=False only. Accepted: x float16/32/64 or uint8 (scaled by 1/255) of
shape (N, C, H, W), (N, H, W) -> (N, 1, H, W) or (N, F) -> (N, F, 1, 1), all finite; y integer
of shape (N,) with labels 0..K-1, K >= 2. `mean` and `std` (C values each, std > 0): every
sample is normalized per channel, x = (x - mean) / std, after the uint8 scaling (`phalanx
datasets import` writes them from the training images), in float32 the same way on every load. `max_bytes` bounds both the file and the arrays it
unpacks to (so a small compressed file cannot expand without limit). Without x_val/y_val a
fixed seeded 20% of the samples becomes the validation split.
"""

from __future__ import annotations

import io
import zipfile

import numpy as np

from engine.dataset import Dataset, DatasetError

ALLOWED_KEYS = ("x", "y", "x_val", "y_val", "mean", "std")
MAX_CLASSES = 65536
_SPLIT_SEED = 0


def validate_npz(data: bytes, max_bytes: int) -> Dataset:
    """The dataset in `data`, or DatasetError naming what is wrong."""
    if len(data) > max_bytes:
        raise DatasetError(f"file is {len(data)} bytes, over the limit of {max_bytes}")
    arrays = _read_arrays(data, max_bytes)
    x, y = _features(arrays["x"], "x"), _labels(arrays["y"], "y", len(arrays["x"]))
    if ("x_val" in arrays) != ("y_val" in arrays):
        raise DatasetError("x_val and y_val must be given together")
    if "x_val" in arrays:
        x_val = _features(arrays["x_val"], "x_val")
        y_val = _labels(arrays["y_val"], "y_val", len(arrays["x_val"]))
        if x_val.shape[1:] != x.shape[1:]:
            raise DatasetError(f"x_val samples have shape {x_val.shape[1:]}, x has {x.shape[1:]}")
    else:
        perm = np.random.default_rng(_SPLIT_SEED).permutation(len(y))
        n_val = len(y) // 5
        x, y, x_val, y_val = x[perm[n_val:]], y[perm[n_val:]], x[perm[:n_val]], y[perm[:n_val]]
    if ("mean" in arrays) != ("std" in arrays):
        raise DatasetError("mean and std must be given together")
    if "mean" in arrays:
        mean, std = _moments(arrays["mean"], arrays["std"], x.shape[1])
        x, x_val = (x - mean) / std, (x_val - mean) / std
    k = int(max(y.max(), y_val.max() if len(y_val) else 0)) + 1
    if k < 2:
        raise DatasetError("y has a single class: labels must span at least 2 classes")
    shape = (int(x.shape[1]), int(x.shape[2]), int(x.shape[3]))
    return Dataset(x, y, x_val, y_val, shape, k)


def _read_arrays(data: bytes, max_bytes: int) -> dict[str, np.ndarray]:
    try:
        with zipfile.ZipFile(io.BytesIO(data)) as zf:
            members = zf.infolist()
    except zipfile.BadZipFile:
        raise DatasetError("not an .npz file (expected a zip archive of .npy arrays)") from None
    keys = [m.filename[:-4] if m.filename.endswith(".npy") else m.filename for m in members]
    unknown = sorted(set(keys) - set(ALLOWED_KEYS))
    if unknown:
        raise DatasetError(f"unexpected arrays {unknown}: allowed are {', '.join(ALLOWED_KEYS)}")
    for need in ("x", "y"):
        if need not in keys:
            raise DatasetError(f"missing array {need!r}: an upload needs x and y")
    unpacked = sum(m.file_size for m in members)
    if unpacked > max_bytes:
        raise DatasetError(f"arrays unpack to {unpacked} bytes, over the limit of {max_bytes}")
    out = {}
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as npz:
            for key in keys:
                out[key] = npz[key]
    except ValueError as exc:
        raise DatasetError(f"arrays must be plain numbers, not objects: {exc}") from None
    except (OSError, EOFError, zipfile.BadZipFile, KeyError) as exc:
        raise DatasetError(f"unreadable .npz: {exc}") from None
    return out


def _features(x: np.ndarray, key: str) -> np.ndarray:
    if x.dtype == np.uint8:
        x = x.astype(np.float32) / 255.0
    elif x.dtype.kind != "f":
        raise DatasetError(f"{key} has dtype {x.dtype}: use float16/32/64 or uint8")
    if x.ndim not in (2, 3, 4):
        raise DatasetError(f"{key} has shape {x.shape}: use (N, C, H, W), (N, H, W) or (N, F)")
    if min(x.shape) < 1:
        raise DatasetError(f"{key} has shape {x.shape}: every dimension must be >= 1")
    x = x.astype(np.float32)
    if not np.isfinite(x).all():
        raise DatasetError(f"{key} has NaN or infinite values (or values beyond float32)")
    if x.ndim == 2:
        return x.reshape(x.shape[0], x.shape[1], 1, 1)
    return x[:, None] if x.ndim == 3 else x


def _moments(mean: np.ndarray, std: np.ndarray, channels: int
             ) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and std, shaped to broadcast over (N, C, H, W)."""
    out = []
    for key, value in (("mean", mean), ("std", std)):
        if value.dtype.kind != "f" or value.shape != (channels,):
            raise DatasetError(f"{key} must be {channels} float values (one per channel), got "
                               f"{value.dtype} of shape {value.shape}")
        if not np.isfinite(value).all():
            raise DatasetError(f"{key} has NaN or infinite values")
        out.append(value.astype(np.float32).reshape(1, channels, 1, 1))
    if (out[1] <= 0).any():
        raise DatasetError("std must be > 0 for every channel")
    return out[0], out[1]


def _labels(y: np.ndarray, key: str, n: int) -> np.ndarray:
    if y.dtype.kind not in "iu":
        raise DatasetError(f"{key} has dtype {y.dtype}: labels must be integers")
    if y.ndim != 1 or len(y) != n:
        raise DatasetError(f"{key} has shape {y.shape}: expected ({n},), one label per sample")
    if n and (y.min() < 0 or y.max() >= MAX_CLASSES):
        raise DatasetError(f"{key} labels must be in 0..{MAX_CLASSES - 1}, "
                           f"got {y.min()}..{y.max()}")
    return y.astype(np.int64)
