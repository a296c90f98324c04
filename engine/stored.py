"""Uploaded datasets on disk, read a few samples at a time: never whole in memory.

An upload (.npz with `x`, `y`, optionally `x_val`, `y_val`, `mean`, `std`) is unpacked once
into a folder of .npy files (`unpack_npz`, member by member in blocks: a compressed member is
inflated as it is copied). `open_folder` checks it in blocks (dtypes, shapes, finite values,
labels) and gives a `Dataset` whose features are `Samples`: views that read the rows asked for
from the file (a memory map opened and dropped per read, so the pages read do not stay in the
process) and turn them into float32 (N, C, H, W) by `normalize`, the one rule every reader
uses: uint8 is scaled by 1/255, (N, H, W) gets a channel axis, (N, F) becomes (N, F, 1, 1),
and with `mean`/`std`, x = (x - mean) / std per channel. The rule works on any subset of rows,
sample by sample, so the control plane, the reference trainer and a phone that normalizes the
stored bytes itself all get the same float32 values.
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.dataset import Dataset, DatasetError

ALLOWED_KEYS = ("x", "y", "x_val", "y_val", "mean", "std")
MAX_CLASSES = 65536
SPLIT_SEED = 0
COPY_BLOCK = 8 << 20
CHECK_BLOCK_BYTES = 64 << 20  # rows read at once while checking a stored array
DISK_MARGIN = 1 << 30  # what an unpacked upload leaves free on the server's disk


# -- the rule -----------------------------------------------------------------------------------

def check_feature_dtype(dtype: np.dtype, shape: tuple[int, ...], key: str) -> None:
    if dtype != np.uint8 and dtype.kind != "f":
        raise DatasetError(f"{key} has dtype {dtype}: use float16/32/64 or uint8")
    if len(shape) not in (2, 3, 4):
        raise DatasetError(f"{key} has shape {shape}: use (N, C, H, W), (N, H, W) or (N, F)")
    if min(shape) < 1:
        raise DatasetError(f"{key} has shape {shape}: every dimension must be >= 1")


def sample_shape(stored: tuple[int, ...]) -> tuple[int, int, int]:
    """(C, H, W) of a sample stored with shape `stored` (N first)."""
    rest = stored[1:]
    if len(rest) == 1:
        return int(rest[0]), 1, 1
    if len(rest) == 2:
        return 1, int(rest[0]), int(rest[1])
    return int(rest[0]), int(rest[1]), int(rest[2])


def normalize(x: np.ndarray, mean: np.ndarray | None = None,
              std: np.ndarray | None = None) -> np.ndarray:
    """Stored rows -> float32 (N, C, H, W): the one rule (module docstring)."""
    if x.dtype == np.uint8:
        x = x.astype(np.float32) / 255.0
    x = x.astype(np.float32)
    if x.ndim == 2:
        x = x.reshape(x.shape[0], x.shape[1], 1, 1)
    elif x.ndim == 3:
        x = x[:, None]
    if mean is not None and std is not None:
        x = (x - mean) / std
    return x


def moments(mean: np.ndarray, std: np.ndarray, channels: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and std, checked and shaped to broadcast over (N, C, H, W)."""
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


def check_labels(y: np.ndarray, key: str, n: int) -> np.ndarray:
    if y.dtype.kind not in "iu":
        raise DatasetError(f"{key} has dtype {y.dtype}: labels must be integers")
    if y.ndim != 1 or len(y) != n:
        raise DatasetError(f"{key} has shape {y.shape}: expected ({n},), one label per sample")
    if n and (y.min() < 0 or y.max() >= MAX_CLASSES):
        raise DatasetError(f"{key} labels must be in 0..{MAX_CLASSES - 1}, "
                           f"got {y.min()}..{y.max()}")
    return y.astype(np.int64)


# -- rows read from disk --------------------------------------------------------------------------

@dataclass(frozen=True)
class StoredArray:
    """Where a .npy file's rows are: its data offset, dtype and the shape after N."""

    offset: int
    dtype: np.dtype
    row_shape: tuple[int, ...]

    @classmethod
    def of(cls, path: Path) -> StoredArray:
        mapped = np.load(path, mmap_mode="r", allow_pickle=False)  # reads the header only
        try:
            if mapped.dtype.hasobject or not mapped.flags.c_contiguous:
                raise DatasetError(f"{path.stem}: a C-ordered array of plain numbers, please")
            return cls(int(mapped.offset), mapped.dtype, tuple(mapped.shape[1:]))
        finally:
            del mapped

    def read(self, path: Path, rows: np.ndarray) -> np.ndarray:
        """These rows (any order, repeats allowed); a run of consecutive rows in one read."""
        rows = np.asarray(rows, dtype=np.int64)
        out = np.empty((len(rows), *self.row_shape), self.dtype)
        if not len(rows):
            return out
        size = out[0].nbytes
        flat = memoryview(out.reshape(len(rows), -1).view(np.uint8)).cast("B")
        breaks = np.flatnonzero(np.diff(rows) != 1) + 1  # where a run of consecutive rows ends
        starts, ends = np.concatenate(([0], breaks)), np.concatenate((breaks, [len(rows)]))
        fd = os.open(path, os.O_RDONLY)
        try:
            for start, end in zip(starts.tolist(), ends.tolist()):
                view = flat[start * size : end * size]
                at = self.offset + int(rows[start]) * size
                while len(view):  # a read returns at most ~2 GiB: go on where it stopped
                    got = os.preadv(fd, [view], at)
                    if got <= 0:
                        raise DatasetError(f"{path.name} is shorter than its header says")
                    view, at = view[got:], at + got
        finally:
            os.close(fd)
        return out


@dataclass(frozen=True, eq=False)
class Samples:
    """Rows of a stored feature array (all of them, or `rows`), read and normalized when
    indexed; `np.asarray` reads them all. Rows are read with pread, not through a memory map:
    a map would leave the pages around every row it touched counted in this process."""

    path: Path
    count: int
    sample: tuple[int, int, int]
    stored: StoredArray
    rows: np.ndarray | None = None  # file rows, in this view's order
    mean: np.ndarray | None = None
    std: np.ndarray | None = None

    def __len__(self) -> int:
        return self.count

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.count, *self.sample)

    ndim = 4
    dtype = np.dtype(np.float32)

    def file_rows(self, key: int | slice | np.ndarray | list[int]) -> np.ndarray:
        """The file's rows for this view's rows `key` (an int gives one)."""
        if isinstance(key, slice):
            index = np.arange(*key.indices(self.count))
        else:
            index = np.atleast_1d(np.asarray(key, dtype=np.int64))
            if len(index) and (index.min() < -self.count or index.max() >= self.count):
                raise IndexError(f"rows {index.min()}..{index.max()} of {self.count}")
            index = np.where(index < 0, index + self.count, index)
        return index if self.rows is None else self.rows[index]

    def take(self, index: np.ndarray) -> Samples:
        """The view of these rows of this view, still on disk."""
        rows = self.file_rows(np.asarray(index, dtype=np.int64))
        return Samples(self.path, len(rows), self.sample, self.stored, rows, self.mean, self.std)

    def raw(self, key: int | slice | np.ndarray | list[int]) -> np.ndarray:
        """The stored rows, as stored (dtype and layout)."""
        return self.stored.read(self.path, self.file_rows(key))

    def __getitem__(self, key: int | slice | np.ndarray | list[int]) -> np.ndarray:
        out = normalize(self.raw(key), self.mean, self.std)
        return out[0] if isinstance(key, (int, np.integer)) else out

    def __array__(self, dtype: object = None, copy: object = None) -> np.ndarray:
        out = self[:]
        return out if dtype is None else out.astype(dtype)

    def blocks(self, rows: int) -> Iterator[np.ndarray]:
        for start in range(0, self.count, rows):
            yield self.raw(slice(start, min(start + rows, self.count)))


# -- unpacking an upload ----------------------------------------------------------------------------

def unpack_npz(source: Path, dest: Path, max_bytes: int) -> None:
    """The arrays of the .npz at `source` as `dest`/<key>.npy (made empty first); their
    unpacked size is bounded by `max_bytes` (a small compressed file cannot expand without
    limit)."""
    try:
        with zipfile.ZipFile(source) as zf:
            members = zf.infolist()
            keys = [m.filename[:-4] if m.filename.endswith(".npy") else m.filename
                    for m in members]
            unknown = sorted(set(keys) - set(ALLOWED_KEYS))
            if unknown:
                raise DatasetError(f"unexpected arrays {unknown}: allowed are "
                                   f"{', '.join(ALLOWED_KEYS)}")
            if len(set(keys)) != len(keys):
                raise DatasetError("an array appears twice in the archive")
            for need in ("x", "y"):
                if need not in keys:
                    raise DatasetError(f"missing array {need!r}: an upload needs x and y")
            unpacked = sum(m.file_size for m in members)
            if unpacked > max_bytes:
                raise DatasetError(f"arrays unpack to {unpacked} bytes, over the limit of "
                                   f"{max_bytes}")
            if dest.exists():
                shutil.rmtree(dest)
            dest.mkdir(parents=True)
            free = shutil.disk_usage(dest).free
            if unpacked + DISK_MARGIN > free:
                raise DatasetError(f"arrays unpack to {unpacked:,} bytes and the server's "
                                   f"disk has {free:,} free: ask its operator for room")
            for member, key in zip(members, keys):
                with zf.open(member) as src, (dest / f"{key}.npy").open("wb") as out:
                    copied = 0
                    while block := src.read(COPY_BLOCK):
                        copied += len(block)
                        if copied > member.file_size:  # the header lied
                            raise DatasetError(f"{key} unpacks past its stated size")
                        out.write(block)
                _c_order(dest / f"{key}.npy")
    except DatasetError:
        raise
    except zipfile.BadZipFile:
        raise DatasetError("not an .npz file (expected a zip archive of .npy arrays)") from None
    except (OSError, EOFError, zipfile.LargeZipFile, NotImplementedError, RuntimeError,
            ValueError) as exc:  # RuntimeError: an encrypted member
        raise DatasetError(f"unreadable .npz: {exc}") from None


def _c_order(path: Path) -> None:
    """A Fortran-ordered array rewritten in C order (rows contiguous, as reads want them), in
    blocks of rows; others are left as they are."""
    try:
        src = np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError:
        return  # objects: refused when the folder is opened, with the reason
    if src.flags.c_contiguous or src.ndim < 2:
        return
    tmp = path.with_suffix(".c.npy")
    out = np.lib.format.open_memmap(tmp, mode="w+", dtype=src.dtype, shape=src.shape)
    rows = max(1, CHECK_BLOCK_BYTES // max(1, src[0].nbytes))
    for start in range(0, len(src), rows):
        out[start : start + rows] = src[start : start + rows]
    out.flush()
    del out, src
    os.replace(tmp, path)


def _stored(folder: Path, key: str) -> np.memmap | None:
    path = folder / f"{key}.npy"
    if not path.is_file():
        return None
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as exc:
        raise DatasetError(f"{key}: arrays must be plain numbers, not objects: {exc}") from None
    except (OSError, EOFError) as exc:
        raise DatasetError(f"{key}: unreadable array: {exc}") from None


def _small(folder: Path, key: str) -> np.ndarray | None:
    stored = _stored(folder, key)
    return None if stored is None else np.array(stored)


def _check_features(folder: Path, key: str, scan: bool = True
                    ) -> tuple[int, tuple[int, int, int]]:
    x = _stored(folder, key)
    assert x is not None
    check_feature_dtype(x.dtype, x.shape, key)
    count, shape, kind = int(x.shape[0]), sample_shape(x.shape), x.dtype.kind
    del x
    if kind == "f" and scan:
        path = folder / f"{key}.npy"
        view = Samples(path, count, shape, StoredArray.of(path))
        per_block = max(1, CHECK_BLOCK_BYTES // max(1, 4 * math.prod(shape)))
        for block in view.blocks(per_block):
            if not np.isfinite(block.astype(np.float32)).all():
                raise DatasetError(f"{key} has NaN or infinite values (or values beyond "
                                   "float32)")
    return count, shape


CHECKED = ".checked"  # written once the upload's arrays were scanned: not scanned again


def open_folder(folder: Path, name: str = "") -> Dataset:
    """The dataset stored in `folder` (by unpack_npz), checked; DatasetError names what is
    wrong. Features stay on disk (Samples); labels are read (8 bytes a sample)."""
    stat = (folder / "x.npy").stat() if (folder / "x.npy").is_file() else None
    if stat is None:
        raise DatasetError(f"no stored dataset in {folder}")
    return _open(str(folder), stat.st_mtime_ns, stat.st_size, name)


@functools.lru_cache(maxsize=16)
def _open(folder_s: str, mtime_ns: int, size: int, name: str) -> Dataset:
    folder = Path(folder_s)
    scan = not (folder / CHECKED).is_file()  # every value finite: checked once, at upload
    n, shape = _check_features(folder, "x", scan)
    y_all = _small(folder, "y")
    assert y_all is not None
    y_all = check_labels(y_all, "y", n)
    has_val = ((folder / "x_val.npy").is_file(), (folder / "y_val.npy").is_file())
    if has_val[0] != has_val[1]:
        raise DatasetError("x_val and y_val must be given together")
    mean_std = (_small(folder, "mean"), _small(folder, "std"))
    if (mean_std[0] is None) != (mean_std[1] is None):
        raise DatasetError("mean and std must be given together")
    mean = std = None
    if mean_std[0] is not None and mean_std[1] is not None:
        mean, std = moments(mean_std[0], mean_std[1], shape[0])
    x_path = folder / "x.npy"
    stored = StoredArray.of(x_path)
    if has_val[0]:
        n_val, val_shape = _check_features(folder, "x_val", scan)
        if val_shape != shape:
            raise DatasetError(f"x_val samples have shape {val_shape}, x has {shape}")
        y_val_raw = _small(folder, "y_val")
        assert y_val_raw is not None
        y_val = check_labels(y_val_raw, "y_val", n_val)
        x_train = Samples(x_path, n, shape, stored, None, mean, std)
        val_path = folder / "x_val.npy"
        x_val = Samples(val_path, n_val, shape, StoredArray.of(val_path), None, mean, std)
        y_train = y_all
    else:  # a fixed seeded 20% of the samples validates
        perm = np.random.default_rng(SPLIT_SEED).permutation(n)
        n_val = n // 5
        train_rows, val_rows = perm[n_val:], perm[:n_val]
        x_train = Samples(x_path, len(train_rows), shape, stored, train_rows, mean, std)
        x_val = Samples(x_path, len(val_rows), shape, stored, val_rows, mean, std)
        y_train, y_val = y_all[train_rows], y_all[val_rows]
    k = int(max(y_train.max() if len(y_train) else 0, y_val.max() if len(y_val) else 0)) + 1
    if k < 2:
        raise DatasetError("y has a single class: labels must span at least 2 classes")
    if scan:
        (folder / CHECKED).write_text("every array checked\n")
    return Dataset(x_train, y_train, x_val, y_val, shape, k, name)  # type: ignore[arg-type]


def check_folder(folder: Path) -> Dataset:
    """Check an unpacked upload (not kept in the cache: it is about to move)."""
    stat = (folder / "x.npy").stat()
    return _open.__wrapped__(str(folder), stat.st_mtime_ns, stat.st_size, "")
