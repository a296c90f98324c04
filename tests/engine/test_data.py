"""Datasets: digits, synthetic names, and every way an upload can be refused."""

from __future__ import annotations

import io
import zipfile

import numpy as np
import pytest

from engine.data import (
    DatasetError,
    dataset_info,
    list_datasets,
    load_dataset,
    upload_path,
    validate_npz,
)
from engine.sampler import permute
from engine.stored import SPLIT_SEED, SPLIT_TAG
from tests.support.arrays import npz_bytes


def _npz(**arrays) -> bytes:
    return npz_bytes(compressed=True, **arrays)


def test_digits_is_built_in_scaled_and_split_the_same_way_every_time():
    d = load_dataset("digits")
    assert d.input_shape == (1, 8, 8) and d.num_classes == 10
    assert d.x_train.dtype == np.float32 and d.x_train.shape == (1438, 1, 8, 8)
    assert 0.0 <= d.x_train.min() and d.x_train.max() <= 1.0
    assert len(d.y_val) == 359 and d.y_train.dtype == np.int64
    assert dataset_info("digits").n_train == 1438


def test_synthetic_names_set_shape_classes_size_and_seed():
    info = dataset_info("synthetic:3x16x12:5:200")
    assert (info.n_train, info.n_val, info.input_shape, info.num_classes) == (200, 50,
                                                                              (3, 16, 12), 5)
    d = load_dataset("synthetic:3x16x12:5:200")
    assert d.x_train.shape == (200, 3, 16, 12) and set(d.y_train.tolist()) <= set(range(5))
    again = load_dataset("synthetic:3x16x12:5:200:0")
    assert np.array_equal(d.x_train, again.x_train)
    other = load_dataset("synthetic:3x16x12:5:200:1")
    assert not np.array_equal(d.x_train, other.x_train)
    assert dataset_info("synthetic").input_shape == (1, 8, 8)


def test_synthetic_classes_are_learnable_by_nearest_class_mean():
    d = load_dataset("synthetic:1x8x8:4:800")
    means = np.stack([d.x_train[d.y_train == c].mean(axis=0).ravel() for c in range(4)])
    dist = ((d.x_val.reshape(len(d.x_val), -1)[:, None, :] - means[None]) ** 2).sum(-1)
    assert (dist.argmin(axis=1) == d.y_val).mean() > 0.9


@pytest.mark.parametrize("name", ["synthetic:3x32", "synthetic:1x8x8:1", "nope", "../etc"])
def test_unknown_or_malformed_names_raise_dataset_error(name, tmp_path):
    with pytest.raises(DatasetError):
        dataset_info(name, tmp_path)


def test_an_upload_left_as_npz_by_an_earlier_version_is_unpacked_listed_and_split(tmp_path):
    x = np.random.default_rng(0).integers(0, 256, (50, 6, 6), dtype=np.uint8)
    y = np.arange(50) % 3
    path = upload_path("my-set", tmp_path)
    assert path == tmp_path / "datasets" / "my-set"
    path.parent.mkdir()
    path.with_name("my-set.npz").write_bytes(_npz(x=x, y=y))
    d = load_dataset("my-set", tmp_path)
    assert (path / "x.npy").is_file()  # unpacked once, read from there on
    assert d.input_shape == (1, 6, 6) and d.num_classes == 3 and d.name == "my-set"
    assert (len(d.y_train), len(d.y_val)) == (40, 10)
    assert d.x_train[:].max() <= 1.0  # uint8 scaled to [0, 1]
    assert [i.name for i in list_datasets(tmp_path)] == ["digits", "my-set"]


def test_stored_features_are_read_per_row_and_equal_the_whole_array_normalized(tmp_path):
    """Out of core: x stays on disk (Samples); any rows read equal the in-memory rule applied
    to the whole array (uint8 / 255, channel axis, per-channel mean and std), bit for bit."""
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, (60, 3, 4, 4), dtype=np.uint8)
    y = np.arange(60) % 4
    mean, std = np.array([0.5, 0.4, 0.3]), np.array([0.2, 0.25, 0.3])
    path = upload_path("imgs", tmp_path)
    path.parent.mkdir()
    path.with_name("imgs.npz").write_bytes(_npz(x=x, y=y, mean=mean, std=std))
    d = load_dataset("imgs", tmp_path)
    assert not isinstance(d.x_train, np.ndarray) and d.x_train.shape == (48, 3, 4, 4)
    whole = ((x.astype(np.float32) / 255.0).astype(np.float32)
             - mean.astype(np.float32).reshape(1, 3, 1, 1)) / std.astype(np.float32).reshape(
                 1, 3, 1, 1)
    # the seeded 80/20 split: positions 0..11 of the split's permutation validate
    perm = permute(60, (SPLIT_SEED, SPLIT_TAG), np.arange(60))
    rows = np.array([7, 0, 31, 7, 47])
    assert np.array_equal(d.x_train[rows], whole[perm[12:]][rows])
    assert np.array_equal(d.x_val[2:9], whole[perm[:12]][2:9])
    assert np.array_equal(np.asarray(d.x_val), whole[perm[:12]])
    assert np.array_equal(d.y_train, y[perm[12:]])


def test_a_fortran_ordered_upload_is_stored_in_rows_and_reads_the_same(tmp_path):
    x = np.asfortranarray(np.random.default_rng(3).standard_normal((30, 2, 3, 3)))
    y = np.arange(30) % 2
    ds = validate_npz(_npz(x=x, y=y, x_val=x[:4], y_val=y[:4]), 10**7)
    np.testing.assert_array_equal(ds.x_train, x.astype(np.float32))


def test_an_upload_with_its_own_validation_split_and_flat_features():
    ds = validate_npz(_npz(x=np.ones((8, 5)), y=np.arange(8) % 2, x_val=np.ones((2, 5)),
                           y_val=np.array([0, 1])), 10**6)
    assert ds.x_train.shape == (8, 5, 1, 1) and ds.input_shape == (5, 1, 1)
    assert len(ds.y_val) == 2


def _zip_with(name: str, payload: bytes) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr(name, payload)
    return buf.getvalue()


X, Y = np.zeros((10, 2, 3, 3), np.float32), np.arange(10) % 2


@pytest.mark.parametrize(("data", "needle"), [
    (b"hello", "not an .npz"),
    (_npz(x=X), "missing array 'y'"),
    (_npz(x=X, y=Y, extra=Y), "unexpected arrays"),
    (_npz(x=X.astype(np.int32), y=Y), "dtype int32"),
    (_npz(x=np.zeros((10,)), y=Y), "shape"),
    (_npz(x=np.zeros((10, 1, 2, 2, 2)), y=Y), "shape"),
    (_npz(x=X, y=Y.astype(np.float32)), "labels must be integers"),
    (_npz(x=X, y=Y[:9]), r"expected \(10,\)"),
    (_npz(x=X, y=Y - 1), "labels must be in"),
    (_npz(x=X, y=np.zeros(10, np.int64)), "single class"),
    (_npz(x=np.full((10, 2, 3, 3), np.nan), y=Y), "NaN or infinite"),
    (_npz(x=X, y=Y, x_val=X[:2]), "together"),
    (_npz(x=X, y=Y, x_val=np.zeros((2, 3, 3, 3)), y_val=Y[:2]), "x_val samples have shape"),
    (_npz(x=np.array([object()] * 10, dtype=object), y=Y), "not objects"),
    (_zip_with("x.npy", b"\x93NUMPY garbage"), "missing array 'y'"),
    (_zip_with("y.npy", b"junk") + b"", "missing array 'x'"),
    (_npz(x=X, y=Y, mean=np.zeros(2, np.float32)), "mean and std must be given together"),
    (_npz(x=X, y=Y, mean=np.zeros(3, np.float32), std=np.ones(3, np.float32)),
     r"mean must be 2 float values \(one per channel\)"),
    (_npz(x=X, y=Y, mean=np.zeros(2, np.float32), std=np.zeros(2, np.float32)),
     "std must be > 0"),
])
def test_bad_uploads_are_refused_saying_what_is_wrong(data, needle):
    with pytest.raises(DatasetError, match=needle):
        validate_npz(data, max_bytes=10**7)


def test_size_limits_cover_the_file_and_what_it_unpacks_to():
    with pytest.raises(DatasetError, match="over the limit of 100"):
        validate_npz(_npz(x=X, y=Y), max_bytes=100)
    zeros = _npz(x=np.zeros((1000, 1, 32, 32), np.float32), y=np.arange(1000) % 2)
    assert len(zeros) < 200_000
    with pytest.raises(DatasetError, match="unpack to"):
        validate_npz(zeros, max_bytes=200_000)


def test_a_corrupt_array_inside_a_valid_zip_is_refused():
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("x.npy", b"\x93NUMPY garbage")
        zf.writestr("y.npy", b"\x93NUMPY garbage")
    with pytest.raises(DatasetError):
        validate_npz(buf.getvalue(), max_bytes=10**6)
