"""A training state as named arrays (the checkpoint .npz) and back.

Keys: each parameter under its layout name (``conv1.weight``), each buffer under its name
(``bn0.running_mean``), momentum under ``momentum/<name>``, and ``step``. A torch user can load
the parameters straight into the same architecture's state dict.
"""

from __future__ import annotations

import io

import numpy as np

from engine.graph import Model
from engine.step import TrainState


def state_to_arrays(model: Model, state: TrainState) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {"step": np.array(state.step, dtype=np.int64)}
    for name, view in model.named(state.params).items():
        out[name] = view.copy()
    for name, view in model.named(state.buffers, "buffers").items():
        out[name] = view.copy()
    for name, view in model.named(state.momentum).items():
        out[f"momentum/{name}"] = view.copy()
    return out


def state_from_arrays(model: Model, arrays: dict[str, np.ndarray]) -> TrainState:
    params = np.zeros(model.n_params, dtype=np.float32)
    momentum = np.zeros(model.n_params, dtype=np.float32)
    buffers = np.zeros(model.n_buffers, dtype=np.float32)
    for name, s in model.layout.items():
        s.view(params)[...] = _get(arrays, name, s.shape)
        s.view(momentum)[...] = _get(arrays, f"momentum/{name}", s.shape)
    for name, s in model.buffer_layout.items():
        s.view(buffers)[...] = _get(arrays, name, s.shape)
    return TrainState(int(_get(arrays, "step", ())), params, momentum, buffers)


def save_npz(arrays: dict[str, np.ndarray]) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    return buf.getvalue()


def load_npz(data: bytes) -> dict[str, np.ndarray]:
    with np.load(io.BytesIO(data), allow_pickle=False) as npz:
        return {k: npz[k] for k in npz.files}


def _get(arrays: dict[str, np.ndarray], name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name not in arrays:
        raise ValueError(f"checkpoint has no array {name!r}")
    value = np.asarray(arrays[name])
    if value.shape != shape:
        raise ValueError(f"checkpoint array {name!r} has shape {value.shape}, expected {shape}")
    return value
