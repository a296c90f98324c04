"""A trained model leaves Phalanx, and a PyTorch model comes in (docs/models.md).

`trained`: a job's model rebuilt from its spec with its checkpoint's arrays; `export`: that as
safetensors or a torch state_dict under torchvision's names, and `onnx_export`: its forward
graph as ONNX, for ONNX Runtime (Mobile) in an app. `onnx_import`: an
ONNX graph of supported operators as `model.layers`. onnx, onnxruntime and safetensors are the
optional extra `export` (torch is `torch`): each is imported where it is used, and a missing one
is a `MissingExtra` that says what to install.
"""

from __future__ import annotations

import importlib
from types import ModuleType

# the extra each optional module comes with (pyproject.toml's optional-dependencies)
EXTRAS = {"onnx": "export", "onnxruntime": "export", "safetensors": "export", "torch": "torch"}


class MissingExtra(ImportError):
    """An optional package this needs is not installed; the message says which extra has it."""


def need(module: str) -> ModuleType:
    """`module` imported, or MissingExtra naming the pip command that brings it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        top = module.split(".")[0]
        extra = EXTRAS.get(top, "export")
        raise MissingExtra(f"this needs the {top} package: pip install 'phalanx[{extra}]'") \
            from None
