"""A training state as named arrays (the checkpoint .npz) and back.

Keys: each parameter under its layout name (``conv1.weight``), each buffer under its name
(``bn0.running_mean``), the optimizer's state under ``<slot>/<name>`` (``momentum/`` for SGD and
LARS, ``exp_avg/`` and ``exp_avg_sq/`` for AdamW: torch's names), and ``step``. A torch user
can load the parameters straight into the same architecture's state dict.
"""

from __future__ import annotations

import io

import numpy as np

from engine.graph import Model
from engine.optim import STATE_SLOTS
from engine.step import TrainState


def state_to_arrays(model: Model, state: TrainState) -> dict[str, np.ndarray]:
    out: dict[str, np.ndarray] = {"step": np.array(state.step, dtype=np.int64)}
    for name, view in model.named(state.params).items():
        out[name] = view.copy()
    for name, view in model.named(state.buffers, "buffers").items():
        out[name] = view.copy()
    n = model.n_params
    for i, slot in enumerate(_slot_names(state.opt_state.size // max(n, 1))):
        for name, view in model.named(state.opt_state[i * n : (i + 1) * n]).items():
            out[f"{slot}/{name}"] = view.copy()
    return out


def state_from_arrays(model: Model, arrays: dict[str, np.ndarray]) -> TrainState:
    """The state in `arrays`; which optimizer state it holds, its names say."""
    n = model.n_params
    slots = _stored_slots(model, arrays)
    params = np.zeros(n, dtype=np.float32)
    opt_state = np.zeros(len(slots) * n, dtype=np.float32)
    buffers = np.zeros(model.n_buffers, dtype=np.float32)
    for name, s in model.layout.items():
        s.view(params)[...] = _get(arrays, name, s.shape)
        for i, slot in enumerate(slots):
            s.view(opt_state[i * n : (i + 1) * n])[...] = _get(arrays, f"{slot}/{name}", s.shape)
    for name, s in model.buffer_layout.items():
        s.view(buffers)[...] = _get(arrays, name, s.shape)
    return TrainState(int(_get(arrays, "step", ())), params, opt_state, buffers)


def _stored_slots(model: Model, arrays: dict[str, np.ndarray]) -> tuple[str, ...]:
    first = next(iter(model.layout))
    for names in STATE_SLOTS.values():
        if f"{names[0]}/{first}" in arrays:
            return names
    return STATE_SLOTS["sgd"]  # and _get names the missing array


def _slot_names(count: int) -> tuple[str, ...]:
    for names in STATE_SLOTS.values():
        if len(names) == count:
            return names
    raise ValueError(f"no optimizer keeps {count} vectors of state")


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
