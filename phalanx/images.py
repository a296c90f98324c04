"""A folder of images, one sub-folder per class, as a dataset upload (`phalanx datasets import`).

The classes are the sub-folders in name order (label 0 is the first); within a class the images
are taken in name order. Every image is decoded with Pillow, converted to RGB (or L with
`grayscale`), resized to `size` x `size` when asked (all images must otherwise share one size),
and kept as uint8 in (N, C, H, W). The per-channel mean and std of the pixel values (scaled to
[0, 1]) over every imported image go with them, so the server normalizes every sample the same
way on every load (engine/upload.py); the server keeps its seeded 20% validation split.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

SUFFIXES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}


class FolderError(ValueError):
    """A folder that cannot be imported; the message names the file or folder."""


@dataclass(frozen=True)
class ImageSet:
    x: np.ndarray  # uint8 (N, C, H, W)
    y: np.ndarray  # int64 (N,)
    classes: tuple[str, ...]
    mean: np.ndarray  # float32 (C,), of x / 255
    std: np.ndarray

    def npz(self) -> bytes:
        buf = io.BytesIO()
        np.savez_compressed(buf, x=self.x, y=self.y, mean=self.mean, std=self.std)
        return buf.getvalue()


def scan(root: Path) -> tuple[list[tuple[Path, int]], tuple[str, ...]]:
    """Every image file with its class index, and the class names."""
    if not root.is_dir():
        raise FolderError(f"{root}: not a folder")
    folders = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if len(folders) < 2:
        raise FolderError(f"{root}: needs one sub-folder per class, at least two "
                           f"(found {len(folders)})")
    items: list[tuple[Path, int]] = []
    for label, folder in enumerate(folders):
        files = sorted(p for p in folder.rglob("*") if p.suffix.lower() in SUFFIXES)
        if not files:
            raise FolderError(f"{folder}: no images ({', '.join(sorted(SUFFIXES))})")
        items += [(f, label) for f in files]
    return items, tuple(f.name for f in folders)


def load(root: Path, size: int | None = None, grayscale: bool = False,
         advance: Callable[[], None] | None = None) -> ImageSet:
    """The folder as an ImageSet; `advance` is called once per image decoded."""
    items, classes = scan(root)
    mode, channels = ("L", 1) if grayscale else ("RGB", 3)
    first_shape: tuple[int, int] | None = None
    x: np.ndarray | None = None
    for i, (path, _) in enumerate(items):
        try:
            with Image.open(path) as img:
                img = img.convert(mode)
                if size:
                    img = img.resize((size, size), Image.Resampling.BILINEAR)
                pixels = np.asarray(img, dtype=np.uint8)
        except (UnidentifiedImageError, OSError) as exc:
            raise FolderError(f"{path}: not a readable image ({exc})") from None
        shape = pixels.shape[:2]
        if first_shape is None:
            first_shape = shape
            x = np.empty((len(items), channels, *shape), dtype=np.uint8)
        elif shape != first_shape:
            raise FolderError(f"{path} is {shape[1]}x{shape[0]} but {items[0][0]} is "
                               f"{first_shape[1]}x{first_shape[0]}: give --size to resize all")
        assert x is not None
        x[i] = pixels[None] if channels == 1 else pixels.transpose(2, 0, 1)
        if advance:
            advance()
    assert x is not None
    y = np.array([label for _, label in items], dtype=np.int64)
    mean, std = channel_moments(x)
    return ImageSet(x, y, classes, mean, std)


def channel_moments(x: np.ndarray, chunk: int = 1024) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and std of x / 255, summed in float64 a chunk of images at a time."""
    total = np.zeros(x.shape[1])
    squares = np.zeros(x.shape[1])
    for lo in range(0, len(x), chunk):
        part = x[lo : lo + chunk].astype(np.float64) / 255.0
        total += part.sum(axis=(0, 2, 3))
        squares += (part * part).sum(axis=(0, 2, 3))
    count = x.shape[0] * x.shape[2] * x.shape[3]
    mean = total / count
    std = np.sqrt(np.maximum(squares / count - mean * mean, 0.0))
    return mean.astype(np.float32), np.maximum(std, 1e-6).astype(np.float32)
