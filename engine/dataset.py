"""The dataset value types, shared by the registry (data.py) and upload validation."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


class DatasetError(ValueError):
    """A dataset that does not exist or is malformed; the message says what is wrong."""


@dataclass(frozen=True)
class DatasetInfo:
    n_train: int
    n_val: int
    input_shape: tuple[int, int, int]
    num_classes: int
    name: str = ""


@dataclass(frozen=True, eq=False)
class Dataset:
    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    input_shape: tuple[int, int, int]
    num_classes: int
    name: str = ""

    def info(self) -> DatasetInfo:
        return DatasetInfo(len(self.y_train), len(self.y_val), self.input_shape,
                           self.num_classes, self.name)
