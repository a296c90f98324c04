"""A trained model (phalanx.modelio.trained) written as ONNX, safetensors or a torch state_dict.

The checkpoint's arrays already carry the names a torch user expects (torchvision's for the
built-ins, the layer names for the rest: engine.checkpoint). What a strict `load_state_dict`
also wants and the engine does not keep is each batch norm's `num_batches_tracked`: it is
written as the checkpoint's step (one running-statistics update per step).
"""

from __future__ import annotations

import io

import numpy as np

from phalanx.modelio import need
from phalanx.modelio.trained import Trained

FORMATS = ("onnx", "safetensors", "torch")
SUFFIXES = {"onnx": ".onnx", "safetensors": ".safetensors", "torch": ".pt"}
BN_COUNTER = "num_batches_tracked"


def state_dict(trained: Trained) -> dict[str, np.ndarray]:
    """Parameters and buffers in module order, as torch's `state_dict()` lists them: each batch
    norm's weight, bias, running_mean, running_var, num_batches_tracked (int64 scalar)."""
    out: dict[str, np.ndarray] = {}
    for name, value in trained.params.items():
        out[name] = value
        prefix = name.removesuffix(".bias")
        if name.endswith(".bias") and f"{prefix}.running_mean" in trained.buffers:
            for buf in ("running_mean", "running_var"):
                out[f"{prefix}.{buf}"] = trained.buffers[f"{prefix}.{buf}"]
            out[f"{prefix}.{BN_COUNTER}"] = np.array(trained.step, np.int64)
    return out


def safetensors_bytes(trained: Trained) -> bytes:
    st = need("safetensors.numpy")
    tensors = {k: np.ascontiguousarray(v) for k, v in state_dict(trained).items()}
    return bytes(st.save(tensors, metadata=trained.metadata))


def torch_bytes(trained: Trained) -> bytes:
    """`torch.save` of a plain dict of tensors: `torch.load(f, weights_only=True)` reads it."""
    torch = need("torch")
    tensors = {k: torch.from_numpy(np.array(v)) for k, v in state_dict(trained).items()}
    buf = io.BytesIO()
    torch.save(tensors, buf)
    return buf.getvalue()


def export_bytes(trained: Trained, fmt: str) -> bytes:
    """The trained model in `fmt` (one of FORMATS)."""
    if fmt == "onnx":
        from phalanx.modelio.onnx_export import onnx_model

        return bytes(onnx_model(trained).SerializeToString())
    if fmt == "safetensors":
        return safetensors_bytes(trained)
    if fmt == "torch":
        return torch_bytes(trained)
    raise ValueError(f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")
