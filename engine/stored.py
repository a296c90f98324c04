"""Uploaded datasets on disk, read a few samples at a time: never whole in memory.

An upload (.npz with `x`, `y`, optionally `x_val`, `y_val`, `mean`, `std`) is unpacked once
into a folder of .npy files (`unpack_npz`, member by member in blocks: a compressed member is
inflated as it is copied). `open_folder` checks it in blocks (dtypes, shapes, finite values,
labels) and gives a `Dataset` whose features are `Samples` and whose labels are `Labels`:
views that read the rows asked for from the file with pread (no memory map: the pages read do
not stay in the process). `Samples` turns its rows into float32 (N, C, H, W) by `normalize`,
the one rule every reader uses: uint8 is scaled by 1/255, (N, H, W) gets a channel axis, (N, F)
becomes (N, F, 1, 1), and with `mean`/`std`, x = (x - mean) / std per channel. The rule works
on any subset of rows, sample by sample, so the control plane, the reference trainer and a
phone that normalizes the stored bytes itself all get the same float32 values; `Labels` gives
its rows as int64.

Nothing here costs memory in proportion to the number of samples: labels are checked and
counted in blocks, the facts found (classes) are kept beside the arrays (`.checked`), and the
seeded train/validation split of an upload without `x_val` is a permutation computed one index
at a time (`engine.sampler.permute`, `PermutedRows`). An opened dataset is a few hundred bytes
(plus its mean and std), kept in a cache bounded in bytes (`OPENED_CACHE_BYTES`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
import threading
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import numpy as np

from engine.dataset import Dataset, DatasetError
from engine.sampler import permute

ALLOWED_KEYS = ("x", "y", "x_val", "y_val", "mean", "std")
MAX_CLASSES = 65536
# one sample's values at most (3x1024x1024 images fit): every read holds at least one sample,
# so this bounds what one row costs the server (16 MiB as float32)
MAX_SAMPLE_VALUES = 1 << 22
SPLIT_SEED = 0
SPLIT_TAG = 0x5B17  # the split's permutation: words (SPLIT_SEED, SPLIT_TAG)
COPY_BLOCK = 8 << 20
CHECK_BLOCK_BYTES = 8 << 20  # bytes of rows read at once while checking a stored array
DISK_MARGIN = 1 << 30  # what an unpacked upload leaves free on the server's disk
OPENED_CACHE_BYTES = 64 << 20  # opened datasets kept (their mean and std; the rest is small)
MERGE_GAP_BYTES = 8 << 10  # rows this close in the file are read with what lies between
READ_SPAN_BYTES = 4 << 20  # at most this much is read at once for rows read together


# -- the rule -----------------------------------------------------------------------------------

def check_feature_dtype(dtype: np.dtype, shape: tuple[int, ...], key: str) -> None:
    if dtype != np.uint8 and dtype.kind != "f":
        raise DatasetError(f"{key} has dtype {dtype}: use float16/32/64 or uint8")
    if len(shape) not in (2, 3, 4):
        raise DatasetError(f"{key} has shape {shape}: use (N, C, H, W), (N, H, W) or (N, F)")
    if min(shape) < 1:
        raise DatasetError(f"{key} has shape {shape}: every dimension must be >= 1")
    if math.prod(shape[1:]) > MAX_SAMPLE_VALUES:
        raise DatasetError(f"{key} has samples of {math.prod(shape[1:]):,} values: at most "
                           f"{MAX_SAMPLE_VALUES:,} a sample")


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


def check_label_dtype(dtype: np.dtype, shape: tuple[int, ...], key: str, n: int) -> None:
    if dtype.kind not in "iu":
        raise DatasetError(f"{key} has dtype {dtype}: labels must be integers")
    if len(shape) != 1 or shape[0] != n:
        raise DatasetError(f"{key} has shape {shape}: expected ({n},), one label per sample")


def label_range(blocks: Iterator[np.ndarray], key: str) -> tuple[int, int] | None:
    """(lowest, highest) label over the blocks (None when there are none), each in
    0..MAX_CLASSES - 1 or DatasetError."""
    low = high = None
    for block in blocks:
        if not len(block):
            continue
        lo, hi = int(block.min()), int(block.max())
        low = lo if low is None else min(low, lo)
        high = hi if high is None else max(high, hi)
    if low is not None and high is not None and (low < 0 or high >= MAX_CLASSES):
        raise DatasetError(f"{key} labels must be in 0..{MAX_CLASSES - 1}, got {low}..{high}")
    return None if low is None or high is None else (low, high)


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

    @property
    def row_bytes(self) -> int:
        return int(self.dtype.itemsize) * math.prod(self.row_shape)

    def read(self, path: Path, rows: np.ndarray) -> np.ndarray:
        """These rows (any order, repeats allowed). Rows close together in the file (gaps of
        at most MERGE_GAP_BYTES, READ_SPAN_BYTES at most in all) are read in one pread with
        what lies between them, a run of consecutive rows in output order straight into the
        answer: memory in proportion to the rows asked for."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        out = np.empty((len(rows), *self.row_shape), self.dtype)
        if not len(rows):
            return out
        size = self.row_bytes
        flat = out.reshape(len(rows), -1).view(np.uint8)
        if rows[-1] - rows[0] == len(rows) - 1 and bool((np.diff(rows) == 1).all()):
            self._pread(path, memoryview(flat.reshape(-1)).cast("B"), int(rows[0]) * size)
            return out  # one run, in order
        order = np.argsort(rows, kind="stable")
        ordered = rows[order]
        span = max(READ_SPAN_BYTES, size)
        # a group ends where the next row is far, or where its span would pass `span`
        cut = (np.diff(ordered) * size > MERGE_GAP_BYTES + size) | (
            np.diff((ordered * size) // span) != 0)
        ends = np.concatenate((np.flatnonzero(cut) + 1, [len(rows)]))
        fd = os.open(path, os.O_RDONLY)
        try:
            start = 0
            for end in ends.tolist():
                first, last = int(ordered[start]), int(ordered[end - 1])
                buf = np.empty((last - first + 1) * size, np.uint8)
                self._pread_fd(fd, path, memoryview(buf).cast("B"), self.offset + first * size)
                flat[order[start:end]] = buf.reshape(-1, size)[ordered[start:end] - first]
                start = end
        finally:
            os.close(fd)
        return out

    def read_run(self, path: Path, first: int, count: int) -> np.ndarray:
        """Rows first .. first + count - 1, in one read."""
        out = np.empty((count, *self.row_shape), self.dtype)
        if count:
            flat = out.reshape(count, -1).view(np.uint8).reshape(-1)
            self._pread(path, memoryview(flat).cast("B"), first * self.row_bytes)
        return out

    def _pread(self, path: Path, view: memoryview, at: int) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            self._pread_fd(fd, path, view, self.offset + at)
        finally:
            os.close(fd)

    @staticmethod
    def _pread_fd(fd: int, path: Path, view: memoryview, at: int) -> None:
        while len(view):  # a read returns at most ~2 GiB: go on where it stopped
            got = os.preadv(fd, [view], at)
            if got <= 0:
                raise DatasetError(f"{path.name} is shorter than its header says")
            view, at = view[got:], at + got


@dataclass(frozen=True)
class PermutedRows:
    """File rows of positions [offset, offset + count) of the seeded permutation of the n rows
    of a file (engine.sampler.permute with `words`): computed for the positions asked for,
    never as a whole. Indexed like an int64 array of `count` rows (by an int64 array)."""

    n: int
    words: tuple[int, ...]
    offset: int
    count: int

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, index: np.ndarray) -> np.ndarray:
        index = np.asarray(index, dtype=np.int64)
        return permute(self.n, self.words, index + self.offset)


Rows = np.ndarray | PermutedRows


def split_rows(n: int) -> tuple[PermutedRows, PermutedRows]:
    """(train, validation) file rows of an upload of n samples without x_val: a fixed seeded
    20% (n // 5) validates. Positions [0, n // 5) of the split's permutation are the validation
    rows, the rest the training rows, in that order."""
    n_val = n // 5
    words = (SPLIT_SEED, SPLIT_TAG)
    return PermutedRows(n, words, n_val, n - n_val), PermutedRows(n, words, 0, n_val)


@dataclass(frozen=True, eq=False)
class _View:
    """Rows of a stored array (all of them, or `rows`: the file's rows in this view's order),
    read when indexed. Rows are read with pread, not through a memory map: a map would leave
    the pages around every row it touched counted in this process."""

    path: Path
    count: int
    stored: StoredArray
    rows: Rows | None = None

    def __len__(self) -> int:
        return self.count

    def file_rows(self, key: int | slice | np.ndarray | list[int]) -> np.ndarray:
        """The file's rows for this view's rows `key` (an int gives one)."""
        if isinstance(key, slice):
            index = np.arange(*key.indices(self.count), dtype=np.int64)
        else:
            index = np.atleast_1d(np.asarray(key, dtype=np.int64))
            if len(index) and (index.min() < -self.count or index.max() >= self.count):
                raise IndexError(f"rows {index.min()}..{index.max()} of {self.count}")
            index = np.where(index < 0, index + self.count, index)
        return index if self.rows is None else self.rows[index]

    def take(self, index: np.ndarray) -> Any:
        """The view of these rows of this view, still on disk."""
        rows = self.file_rows(np.asarray(index, dtype=np.int64))
        return dataclasses.replace(self, count=len(rows), rows=rows)

    def raw(self, key: int | slice | np.ndarray | list[int]) -> np.ndarray:
        """The stored rows, as stored (dtype and layout); a slice of a view of every row in
        file order is one run, read without an index array."""
        if isinstance(key, slice) and self.rows is None:
            start, stop, step = key.indices(self.count)
            if step == 1:
                return self.stored.read_run(self.path, start, max(0, stop - start))
        return self.stored.read(self.path, self.file_rows(key))

    def blocks(self, rows: int) -> Iterator[np.ndarray]:
        for start in range(0, self.count, rows):
            yield self.raw(slice(start, min(start + rows, self.count)))


@dataclass(frozen=True, eq=False)
class Samples(_View):
    """A stored feature array's rows, normalized (float32 (N, C, H, W)) when indexed;
    `np.asarray` reads them all."""

    sample: tuple[int, int, int] = (1, 1, 1)
    mean: np.ndarray | None = None
    std: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.count, *self.sample)

    ndim = 4
    dtype = np.dtype(np.float32)

    def __getitem__(self, key: int | slice | np.ndarray | list[int]) -> np.ndarray:
        out = normalize(self.raw(key), self.mean, self.std)
        return out[0] if isinstance(key, (int, np.integer)) else out

    def __array__(self, dtype: object = None, copy: object = None) -> np.ndarray:
        out = self[:]
        return out if dtype is None else out.astype(dtype)


@dataclass(frozen=True, eq=False)
class Labels(_View):
    """A stored label array's rows, as int64 when indexed; `np.asarray` reads them all."""

    @property
    def shape(self) -> tuple[int]:
        return (self.count,)

    ndim = 1
    dtype = np.dtype(np.int64)

    def __getitem__(self, key: int | slice | np.ndarray | list[int]) -> Any:
        out = self.raw(key).astype(np.int64)
        return int(out[0]) if isinstance(key, (int, np.integer)) else out

    def __array__(self, dtype: object = None, copy: object = None) -> np.ndarray:
        out = self[:]
        return out if dtype is None else out.astype(dtype)

    def tolist(self) -> list[int]:
        return self[:].tolist()


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
    blocks of rows, each read through a map opened and dropped for it (the pages it touched
    leave the process with it); others are left as they are."""
    try:
        src = np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError:
        return  # objects: refused when the folder is opened, with the reason
    if src.flags.c_contiguous or src.ndim < 2:
        return
    dtype, shape = src.dtype, tuple(src.shape)
    del src
    tmp = path.with_suffix(".c.npy")
    rows = max(1, CHECK_BLOCK_BYTES // max(1, dtype.itemsize * math.prod(shape[1:])))
    with tmp.open("wb") as out:
        np.lib.format.write_array_header_2_0(out, {
            "descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False,
            "shape": shape})
        for start in range(0, shape[0], rows):
            src = np.load(path, mmap_mode="r", allow_pickle=False)
            block = np.ascontiguousarray(src[start : start + rows])
            del src
            out.write(memoryview(block).cast("B"))
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


def _header(folder: Path, key: str) -> tuple[np.dtype, tuple[int, ...]] | None:
    """The stored array's dtype and shape (its header only), or None when there is none."""
    stored = _stored(folder, key)
    if stored is None:
        return None
    try:
        return stored.dtype, tuple(int(d) for d in stored.shape)
    finally:
        del stored


def _moments(folder: Path, channels: int) -> tuple[np.ndarray | None, np.ndarray | None]:
    """The upload's mean and std, their headers checked before a byte of them is read."""
    got = {key: _header(folder, key) for key in ("mean", "std")}
    if (got["mean"] is None) != (got["std"] is None):
        raise DatasetError("mean and std must be given together")
    if got["mean"] is None:
        return None, None
    for key, (dtype, shape) in got.items():  # type: ignore[misc]
        if dtype.kind != "f" or shape != (channels,):
            raise DatasetError(f"{key} must be {channels} float values (one per channel), got "
                               f"{dtype} of shape {shape}")
    mean, std = (np.array(_stored(folder, key)) for key in ("mean", "std"))
    return moments(mean, std, channels)


def _features(folder: Path, key: str, scan: bool) -> tuple[int, tuple[int, int, int]]:
    """x's (or x_val's) sample count and (C, H, W), checked; `scan`: every value finite too
    (float arrays, in blocks of CHECK_BLOCK_BYTES)."""
    header = _header(folder, key)
    assert header is not None
    dtype, full = header
    check_feature_dtype(dtype, full, key)
    count, shape = full[0], sample_shape(full)
    if dtype.kind == "f" and scan:
        path = folder / f"{key}.npy"
        stored = StoredArray.of(path)
        view = Samples(path, count, stored, sample=shape)
        per_row = max(stored.row_bytes, 4 * math.prod(shape), 1)
        for block in view.blocks(max(1, CHECK_BLOCK_BYTES // per_row)):
            if not np.isfinite(block.astype(np.float32)).all():
                raise DatasetError(f"{key} has NaN or infinite values (or values beyond "
                                   "float32)")
    return count, shape


def _labels(folder: Path, key: str, n: int) -> Labels:
    header = _header(folder, key)
    if header is None:
        raise DatasetError(f"missing array {key!r}")
    check_label_dtype(*header, key, n)
    path = folder / f"{key}.npy"
    return Labels(path, n, StoredArray.of(path))


def _label_blocks(labels: Labels) -> Iterator[np.ndarray]:
    return labels.blocks(max(1, CHECK_BLOCK_BYTES // max(1, labels.stored.row_bytes)))


CHECKED = ".checked"  # written once the upload's arrays were scanned: not scanned again
FACTS_VERSION = 1


def _read_facts(folder: Path) -> dict[str, Any] | None:
    """What the scan at upload found (`.checked`: JSON), or None: not scanned (scan it), or
    scanned by an earlier version that kept no facts ({}: the labels are counted again)."""
    try:
        text = (folder / CHECKED).read_text()
    except OSError:
        return None
    try:
        facts = json.loads(text)
    except ValueError:
        return {}
    ok = isinstance(facts, dict) and facts.get("version") == FACTS_VERSION and isinstance(
        facts.get("classes"), int) and not isinstance(facts.get("classes"), bool)
    return facts if ok else {}


def _write_facts(folder: Path, facts: dict[str, Any]) -> None:
    tmp = folder / f"{CHECKED}.{os.getpid()}.{threading.get_ident()}"
    try:
        tmp.write_text(json.dumps({"version": FACTS_VERSION, **facts}) + "\n")
        os.replace(tmp, folder / CHECKED)
    except OSError:  # a folder this process may not write: counted again next time
        tmp.unlink(missing_ok=True)


# -- a cache bounded in bytes ---------------------------------------------------------------------

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class ByteCache(Generic[K, V]):
    """Values by key, newest first, up to `limit` bytes in all (each weighs `weigh(value)`);
    a value heavier than the limit is not kept. Thread-safe; `get_or_make` makes a missing
    value once at a time (two threads asking for one never both build it) and frees room for
    it first when told how much it will weigh (`expect`)."""

    def __init__(self, limit: int, weigh: Callable[[V], int]) -> None:
        self.limit, self.weigh, self.used = limit, weigh, 0
        self._data: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._lock = threading.Lock()
        self._making = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            got = self._data.get(key)
            if got is None:
                return None
            self._data.move_to_end(key)
            return got[0]

    def put(self, key: K, value: V) -> None:
        weight = int(self.weigh(value))
        with self._lock:
            self._drop(key)
            if weight > self.limit:
                return
            self._data[key] = (value, weight)
            self.used += weight
            self._evict(0)

    def get_or_make(self, key: K, make: Callable[[], V], expect: int = 0) -> V:
        found = self.get(key)
        if found is not None:
            return found
        with self._making:
            found = self.get(key)
            if found is not None:
                return found
            with self._lock:
                self._evict(min(int(expect), self.limit))
            value = make()
            self.put(key, value)
            return value

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self.used = 0

    def __len__(self) -> int:
        return len(self._data)

    def _drop(self, key: K) -> None:
        old = self._data.pop(key, None)
        if old is not None:
            self.used -= old[1]

    def _evict(self, room: int) -> None:
        while self._data and self.used + room > self.limit:
            _, (_, weight) = self._data.popitem(last=False)
            self.used -= weight


def dataset_bytes(ds: Dataset) -> int:
    """What a Dataset holds in memory: its arrays' bytes (a view on disk: its mean, std and
    rows), plus a little for the objects."""
    total = 1024
    for part in (ds.x_train, ds.y_train, ds.x_val, ds.y_val):
        if isinstance(part, np.ndarray):
            total += part.nbytes
        elif isinstance(part, _View):
            total += 256 + (part.rows.nbytes if isinstance(part.rows, np.ndarray) else 0)
            if isinstance(part, Samples):
                total += sum(m.nbytes for m in (part.mean, part.std) if m is not None)
    return total


# -- opening a stored upload ----------------------------------------------------------------------

OPENED: ByteCache[tuple[str, int, int, str], Dataset] = ByteCache(OPENED_CACHE_BYTES,
                                                                   dataset_bytes)


def open_folder(folder: Path, name: str = "") -> Dataset:
    """The dataset stored in `folder` (by unpack_npz), checked; DatasetError names what is
    wrong. Features and labels stay on disk (Samples, Labels)."""
    stat = (folder / "x.npy").stat() if (folder / "x.npy").is_file() else None
    if stat is None:
        raise DatasetError(f"no stored dataset in {folder}")
    key = (str(folder), stat.st_mtime_ns, stat.st_size, name)
    return OPENED.get_or_make(key, lambda: _open(folder, name))


def _open(folder: Path, name: str) -> Dataset:
    facts = _read_facts(folder)
    scan = facts is None  # every value finite: checked once, at upload
    n, shape = _features(folder, "x", scan)
    y_all = _labels(folder, "y", n)
    has_val = ((folder / "x_val.npy").is_file(), (folder / "y_val.npy").is_file())
    if has_val[0] != has_val[1]:
        raise DatasetError("x_val and y_val must be given together")
    mean, std = _moments(folder, shape[0])
    x_path = folder / "x.npy"
    stored = StoredArray.of(x_path)
    if has_val[0]:
        n_val, val_shape = _features(folder, "x_val", scan)
        if val_shape != shape:
            raise DatasetError(f"x_val samples have shape {val_shape}, x has {shape}")
        y_val = _labels(folder, "y_val", n_val)
        x_train = Samples(x_path, n, stored, sample=shape, mean=mean, std=std)
        val_path = folder / "x_val.npy"
        x_val = Samples(val_path, n_val, StoredArray.of(val_path), sample=shape, mean=mean,
                        std=std)
        y_train = y_all
        every = [y_train, y_val]
    else:  # a fixed seeded 20% of the samples validates (split_rows)
        train_rows, val_rows = split_rows(n)
        x_train = Samples(x_path, len(train_rows), stored, train_rows, shape, mean, std)
        x_val = Samples(x_path, len(val_rows), stored, val_rows, shape, mean, std)
        y_train = dataclasses.replace(y_all, count=len(train_rows), rows=train_rows)
        y_val = dataclasses.replace(y_all, count=len(val_rows), rows=val_rows)
        every = [y_all]
    if facts:  # counted at upload
        k = int(facts["classes"])
    else:  # the labels in blocks, in file order: the highest is the same in any order
        ranges = [r for labels, key in zip(every, ("y", "y_val"))
                  if (r := label_range(_label_blocks(labels), key)) is not None]
        k = max((hi for _, hi in ranges), default=0) + 1
    if k < 2:
        raise DatasetError("y has a single class: labels must span at least 2 classes")
    if not facts:
        _write_facts(folder, {"classes": k})
    return Dataset(x_train, y_train, x_val, y_val, shape, k, name)  # type: ignore[arg-type]


def check_folder(folder: Path) -> Dataset:
    """Check an unpacked upload, every value (not kept in the cache: it is about to move)."""
    (folder / CHECKED).unlink(missing_ok=True)
    return _open(folder, "")
