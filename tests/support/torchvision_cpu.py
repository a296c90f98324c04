"""torchvision's models on the CPU-only torch wheel that the test install uses.

PyPI's torchvision wheels are built against CUDA torch: beside torch's +cpu wheel their C++
ops (`torchvision._C`: nms, roi_align, ...) do not load, and torchvision then fails at import,
registering a fake kernel for `torchvision::nms`, an op that library would have defined. The
models are pure Python and call none of those ops, so the two schemas its import registers
against are declared here and the import finishes; calling nms would still fail loudly.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType
from typing import Any

from tests.support.optional import require

_SCHEMAS: list[Any] = []  # the Library that declares them: kept alive, or they go away


def torchvision() -> ModuleType:
    torch = require("torch")
    try:
        return require("torchvision")
    except RuntimeError as exc:
        if "torchvision::nms" not in str(exc):
            raise
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]
    lib = torch.library.Library("torchvision", "DEF")
    for op in ("nms", "qnms"):
        lib.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _SCHEMAS.append(lib)
    return importlib.import_module("torchvision")
