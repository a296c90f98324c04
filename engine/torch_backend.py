"""The PyTorch backend: the same layers (each layer's `torch_forward`), the same flat layout.

torch is optional and imported here only when this backend is asked for. Parameters are views
of one leaf tensor, so autograd's gradient of the summed loss is directly the flat grad_sum.
Dropout masks come from the same numpy generator as the numpy backend, so both backends see
the same mask for (seed, step, shard, layer).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from engine.base import Ctx
from engine.graph import LossGrad, Model


def available() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise RuntimeError("backend 'torch' needs PyTorch installed (pip install torch)") from exc
    return torch


def loss_and_grad(model: Model, params: np.ndarray, buffers: np.ndarray, x: np.ndarray,
                  y: np.ndarray, seed: int = 0, step: int = 0, shard: int = 0,
                  label_smoothing: float = 0.0) -> LossGrad:
    torch = _torch()
    import torch.nn.functional as F

    flat = torch.tensor(params, requires_grad=True)
    ctx = Ctx(True, seed, step, shard, model.named(torch.from_numpy(buffers.copy()), "buffers"))
    xt = torch.from_numpy(np.ascontiguousarray(x, dtype=params.dtype))
    logits = model.net.torch_forward(xt, model.named(flat), ctx)
    yt = torch.from_numpy(np.asarray(y, dtype=np.int64))
    loss = F.cross_entropy(logits, yt, reduction="sum", label_smoothing=label_smoothing)
    loss.backward()
    out = logits.detach().numpy()
    stats = np.zeros(model.n_stats, dtype=params.dtype)
    for name, s in model.stats_layout.items():
        stats[s.offset : s.offset + s.size] = ctx.stats[name].detach().numpy().ravel()
    correct = int((out.argmax(axis=1) == y).sum())
    return LossGrad(flat.grad.numpy().copy(), float(loss.item()), correct, len(y), stats)


def logits(model: Model, params: np.ndarray, buffers: np.ndarray, x: np.ndarray) -> np.ndarray:
    torch = _torch()
    with torch.no_grad():
        ctx = Ctx(False, buffers=model.named(torch.from_numpy(buffers.copy()), "buffers"))
        xt = torch.from_numpy(np.ascontiguousarray(x, dtype=params.dtype))
        return model.net.torch_forward(xt, model.named(torch.from_numpy(params.copy())),
                                       ctx).numpy()
