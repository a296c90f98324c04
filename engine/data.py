"""Datasets: the registry (`digits`, `synthetic:...`, uploads) and upload validation.

Names:
* ``digits`` — scikit-learn's bundled 8x8 digits (no download): x scaled to [0, 1] as float32
  (N, 1, 8, 8), a fixed seeded 80/20 train/validation split (1438 / 359).
* ``synthetic[:CxHxW[:K[:N[:SEED]]]]`` — generated from SEED (default 0): N training samples
  (default 2048) plus N // 4 validation samples, K classes (default 10) of shape C x H x W
  (default 1x8x8). Each class is a smooth random pattern; a sample is its class pattern plus
  Gaussian noise, so the task is learnable but not trivial. E.g. ``synthetic:3x32x32:10:4096``.
* anything else — an upload stored by the API as the folder ``<data_dir>/datasets/<name>/``
  (engine/stored.py: its features are read from disk a few rows at a time, never whole); a
  ``<name>.npz`` left by an earlier version is unpacked into that folder when first loaded.

Only the control plane loads datasets; phones get their shards' samples over HTTP. So
scikit-learn is imported inside the digits loader alone.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import uuid
from pathlib import Path

import numpy as np

from engine.dataset import Dataset, DatasetError, DatasetInfo
from engine.stored import ByteCache, dataset_bytes, open_folder
from engine.upload import validate_file, validate_npz

__all__ = ["Dataset", "DatasetInfo", "DatasetError", "validate_npz", "load_dataset",
           "dataset_info", "list_datasets", "upload_path", "NAME_RE"]

# \Z, not $ (which also matches before a final newline: "adv5\n" would pass); [0-9], not \d
# (which matches any Unicode digit)
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")
_SYNTH_RE = re.compile(r"^synthetic(?::([0-9]+)x([0-9]+)x([0-9]+))?(?::([0-9]+))?(?::([0-9]+))?(?::([0-9]+))?\Z")
_DIGITS_SPLIT_SEED = 0
# a synthetic dataset is generated whole and kept in memory: at most this many bytes of it
# (float32 samples and int64 labels, validation included), and one at a time in the cache
MAX_SYNTHETIC_BYTES = 1 << 30
SYNTHETIC_BLOCK_VALUES = 1 << 20  # generated this many values at a time
SYNTHETIC_CACHE: ByteCache[str, Dataset] = ByteCache(MAX_SYNTHETIC_BYTES + (1 << 20),
                                                     dataset_bytes)


def upload_path(name: str, data_dir: str | Path | None) -> Path | None:
    """The folder where the API stores an uploaded dataset called `name`."""
    root = data_dir if data_dir is not None else os.environ.get("PHALANX_DATA_DIR")
    if root is None or not NAME_RE.match(name):
        return None
    return Path(root) / "datasets" / name


def _unpack_legacy(folder: Path) -> None:
    """An earlier version's `<name>.npz` as the folder this one reads (once; replicas racing
    here each unpack to their own staging folder, and the first rename wins)."""
    legacy = folder.with_name(folder.name + ".npz")
    if folder.is_dir() or not legacy.is_file():
        return
    staging = folder.with_name(f".{folder.name}.{uuid.uuid4().hex}.unpack")
    try:
        validate_file(legacy, staging, max_bytes=1 << 40)
        os.replace(staging, folder)
    except OSError:
        if not folder.is_dir():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def load_dataset(name: str, data_dir: str | Path | None = None) -> Dataset:
    """The dataset called `name` (raises DatasetError when there is none)."""
    if name == "digits":
        return _digits()
    if name.startswith("synthetic"):
        return _synthetic(name)
    path = upload_path(name, data_dir)
    if path is not None:
        _unpack_legacy(path)
    if path is None or not path.is_dir():
        raise DatasetError(f"unknown dataset {name!r}: not digits, synthetic:... or an upload")
    return open_folder(path, name)


def dataset_info(name: str, data_dir: str | Path | None = None) -> DatasetInfo:
    """Sizes and shapes of `name` (synthetic ones without generating them)."""
    if name.startswith("synthetic"):
        c, h, w, k, n, _ = _parse_synthetic(name)
        return DatasetInfo(n, n // 4, (c, h, w), k, name)
    return load_dataset(name, data_dir).info()


def list_datasets(data_dir: str | Path | None = None) -> list[DatasetInfo]:
    """digits and every stored upload (synthetic ones are generated on demand, not listed)."""
    out = [dataset_info("digits")]
    root = data_dir if data_dir is not None else os.environ.get("PHALANX_DATA_DIR")
    folder = Path(root) / "datasets" if root is not None else None
    if folder is not None and folder.is_dir():
        names = {p.name for p in folder.iterdir() if p.is_dir() and NAME_RE.match(p.name)}
        names |= {p.stem for p in folder.glob("*.npz")}
        for name in sorted(names):
            try:
                out.append(dataset_info(name, root))
            except DatasetError:
                continue  # a half-written or foreign file is not a dataset
    return out


@functools.lru_cache(maxsize=1)
def _digits() -> Dataset:
    from sklearn.datasets import load_digits

    raw = load_digits()
    x = (raw.data.astype(np.float32) / 16.0).reshape(-1, 1, 8, 8)
    y = raw.target.astype(np.int64)
    perm = np.random.default_rng(_DIGITS_SPLIT_SEED).permutation(len(y))
    n_val = len(y) // 5
    val, train = perm[:n_val], perm[n_val:]
    return Dataset(x[train], y[train], x[val], y[val], (1, 8, 8), 10, "digits")


def _parse_synthetic(name: str) -> tuple[int, int, int, int, int, int]:
    m = _SYNTH_RE.match(name)
    if not m:
        raise DatasetError(f"bad synthetic dataset name {name!r}: "
                           "use synthetic[:CxHxW[:classes[:samples[:seed]]]]")
    c, h, w = (int(v) for v in m.group(1, 2, 3)) if m.group(1) else (1, 8, 8)
    k = int(m.group(4) or 10)
    n = int(m.group(5) or 2048)
    seed = int(m.group(6) or 0)
    if min(c, h, w) < 1 or k < 2 or n < 1:
        raise DatasetError(f"{name!r}: shape dims and samples must be >= 1, classes >= 2")
    if _synthetic_bytes(c, h, w, n) > MAX_SYNTHETIC_BYTES:
        raise DatasetError(f"{name!r} is too large to generate: at most "
                           f"{MAX_SYNTHETIC_BYTES:,} bytes of samples and labels")
    return c, h, w, k, n, seed


def _synthetic_bytes(c: int, h: int, w: int, n: int) -> int:
    """What it holds (Python integers): float32 samples and int64 labels, validation too."""
    return (n + n // 4) * (4 * c * h * w + 8)


def _pattern_bytes(c: int, h: int, w: int, k: int) -> int:
    return 8 * k * c * ((h + 3) // 4) * ((w + 3) // 4)


def _synthetic(name: str) -> Dataset:
    c, h, w, _, n, _ = _parse_synthetic(name)
    return SYNTHETIC_CACHE.get_or_make(name, lambda: _generate(name),
                                       expect=_synthetic_bytes(c, h, w, n))


def _generate(name: str) -> Dataset:
    """Each class a smooth random pattern (a coarse grid, each value repeated over 4x4
    pixels), each sample its class's pattern plus noise. The samples are drawn a block at a
    time from the one stream (the same values as one draw of them all) and their patterns
    expanded per block, so generating holds the result and a block, not float64 copies."""
    c, h, w, k, n, seed = _parse_synthetic(name)
    if _pattern_bytes(c, h, w, k) > MAX_SYNTHETIC_BYTES:
        raise DatasetError(f"{name!r} has too many classes to generate")
    rng = np.random.default_rng(np.random.SeedSequence([seed, 0x5E7]))
    coarse = rng.standard_normal((k, c, (h + 3) // 4, (w + 3) // 4))
    total = n + n // 4
    y = rng.integers(0, k, total).astype(np.int64)
    x = np.empty((total, c, h, w), np.float32)
    rows = max(1, SYNTHETIC_BLOCK_VALUES // (c * h * w))
    for start in range(0, total, rows):
        end = min(start + rows, total)
        pattern = coarse[y[start:end]].repeat(4, axis=2).repeat(4, axis=3)[:, :, :h, :w]
        x[start:end] = pattern + 1.5 * rng.standard_normal((end - start, c, h, w))
    return Dataset(x[:n], y[:n], x[n:], y[n:], (c, h, w), k, name)
