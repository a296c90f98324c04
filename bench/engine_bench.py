"""numpy vs torch, single thread, same inputs: a 3x3 conv layer, mobilenet_v1, and resnet50 and
mobilenet_v2 at 224x224 (batch 32, 1000 classes), forward + backward.

Run:  env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE .venv/bin/python bench/engine_bench.py [--reps 7]
      [--cases 224 --reps 2 --no-trainer]   (only the full-size models: minutes, ~10 GB)
Then trains the DESIGN.md digits cnn spec with the reference trainer (numpy backend) and
prints its samples/s. Prints each case's best-of-reps time for both backends and the ratio torch_time / numpy_time
(numpy's speed as a fraction of torch's; the target is >= 0.5). Reps alternate backends so
machine noise hits both alike.
"""

from __future__ import annotations

import os

os.environ["OPENBLAS_NUM_THREADS"] = "1"  # before numpy is imported: one BLAS thread
os.environ["OMP_NUM_THREADS"] = "1"

import argparse  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.base import Builder, Ctx, to_nhwc  # noqa: E402
from engine.conv import Conv2d  # noqa: E402
from engine.models import build_model  # noqa: E402


def best(fns: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    for fn in fns.values():
        fn()  # warm-up: allocations, torch's first-call setup
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {k: min(v) for k, v in times.items()}


def conv_case(torch) -> dict[str, Callable[[], object]]:
    import torch.nn.functional as F

    layer, b = Conv2d(64, 3, "c"), Builder()
    layer.build((32, 32, 32), b)
    rng = np.random.default_rng(0)
    params = (rng.standard_normal(sum(s.size for s in b.params)) * 0.05).astype(np.float32)
    P = {s.name: s.view(params) for s in b.params}
    G = {s.name: np.zeros(s.shape, np.float32) for s in b.params}
    x = rng.standard_normal((32, 32, 32, 32)).astype(np.float32)
    x_nhwc, dy = to_nhwc(x), rng.standard_normal((32, 32, 32, 64)).astype(np.float32)
    ctx = Ctx(True)

    def numpy_step():
        _, cache = layer.forward(x_nhwc, P, ctx)
        return layer.backward(dy, cache, P, G)

    xt = torch.from_numpy(x).requires_grad_()
    wt = torch.from_numpy(P["c.weight"].copy()).requires_grad_()
    bt = torch.from_numpy(P["c.bias"].copy()).requires_grad_()
    dyt = torch.from_numpy(np.ascontiguousarray(dy.transpose(0, 3, 1, 2)))

    def torch_step():
        y = F.conv2d(xt, wt, bt, 1, 1)
        y.backward(dyt)

    return {"numpy": numpy_step, "torch": torch_step}


def model_case(arch: str, shape, width: float, classes: int = 10
               ) -> Callable[[], dict[str, Callable[[], object]]]:
    """Built when its case runs: a 224x224 resnet50's inputs and caches take gigabytes."""
    return lambda: _model_fns(arch, shape, width, classes)


def _model_fns(arch: str, shape, width: float, classes: int) -> dict[str, Callable[[], object]]:
    from engine import torch_backend

    model = build_model(arch, shape, classes, {"width": width})
    params, buffers = model.init(0)
    rng = np.random.default_rng(0)
    x = rng.random((32, *shape), dtype=np.float32)
    y = rng.integers(0, classes, 32)
    return {
        "numpy": lambda: model.loss_and_grad(params, buffers, x, y),
        "torch": lambda: torch_backend.loss_and_grad(model, params, buffers, x, y),
    }


def blas_kernel() -> str:
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return "unknown"
    kinds = [i.get("architecture", "?") for i in threadpool_info() if i.get("internal_api") ==
             "openblas"]
    return ",".join(kinds) or "none"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--cases", default="", help="only the cases whose name holds this text")
    ap.add_argument("--no-trainer", action="store_true", help="skip the reference trainer run")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    cases = {
        "conv3x3 b32 32->64 32x32 fwd+bwd": lambda: conv_case(torch),
        "mobilenet_v1 w1.0 b32 3x32x32 fwd+bwd": model_case("mobilenet_v1", (3, 32, 32), 1.0),
        "cnn b32 1x8x8 fwd+bwd": model_case("cnn", (1, 8, 8), 1.0),
        # the seed papers' models at full size (targets: resnet50 >= 0.7x, mobilenet_v2 >= 1.0x)
        "resnet50 b32 3x224x224 1000 classes": model_case("resnet50", (3, 224, 224), 1.0, 1000),
        "mobilenet_v2 b32 3x224x224 1000 classes": model_case("mobilenet_v2", (3, 224, 224), 1.0,
                                                              1000),
    }
    cases = {name: make for name, make in cases.items() if args.cases in name}
    print(f"numpy {np.__version__} (OpenBLAS kernel {blas_kernel()}), torch {torch.__version__}, "
          f"1 thread each, best of {args.reps}")
    print(f"{'case':42} {'numpy ms':>9} {'torch ms':>9} {'numpy speed / torch':>20}")
    for name, make in cases.items():
        t = best(make(), args.reps)
        print(f"{name:42} {t['numpy'] * 1e3:9.2f} {t['torch'] * 1e3:9.2f} "
              f"{t['torch'] / t['numpy']:19.2f}x", flush=True)
    if not args.no_trainer:
        reference_trainer()


def reference_trainer() -> None:
    from phalanx.train_local import run_reference

    spec = {"name": "digits-cnn", "model": {"arch": "cnn"}, "dataset": "digits",
            "global_batch_size": 256, "shards": 16, "epochs": 20, "seed": 0,
            "optimizer": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.0001,
                          "warmup_epochs": 2, "schedule": "cosine"}}
    m = run_reference(spec, None, progress=False)
    print(f"reference trainer, digits cnn (16 shards x 16 samples, 100 steps): "
          f"{m['samples_per_s']:,.0f} samples/s, {m['seconds']:.2f} s, "
          f"val_accuracy {m['val_accuracy']:.4f}")


if __name__ == "__main__":
    main()
