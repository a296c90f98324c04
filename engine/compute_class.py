"""A machine's compute class, and the digests that prove (or disprove) exactness across CPUs.

Two machines are of one compute class when a `class` job's shard gives the same bytes on both:
the same CPU architecture, numpy version, BLAS library, version and kernel, and numpy SIMD
level. The agent reports `describe()` in its capabilities; `fingerprint` is the digest of a
fixed shard computed with the `class` kernels at start, so two phones that claim the same facts
but compute other bits are still told apart (scheduler: a `class` job's shards stay on the
fingerprint its first placement chose).

`python -m engine.compute_class` prints the facts and, with `--digests`, the digests of one
shard of each probe model and of a few applied steps: the CI compares them across OpenBLAS
kernels, numpy SIMD levels and ARM64 CPUs (tests/engine/test_portable.py, tests/arm64/).
Engine-only (numpy and the standard library), so it runs wherever the agent runs.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import platform
import sys
from typing import Any

import numpy as np

from engine.models import build_model
from engine.spec import TrainSpec
from engine.step import ShardResult, apply_step, compute_shard, initial_state

# name -> (job spec fields, input shape, classes): the models the cross-CPU proof covers
PROBES: dict[str, tuple[dict[str, Any], tuple[int, int, int], int]] = {
    "mlp": ({"model": {"arch": "mlp", "dropout": 0.2}, "label_smoothing": 0.1}, (1, 8, 8), 10),
    "cnn": ({"model": {"arch": "cnn"}}, (1, 8, 8), 10),
    "resnet18": ({"model": {"arch": "resnet18", "width": 0.25}}, (3, 32, 32), 10),
    "mobilenet_v2": ({"model": {"arch": "mobilenet_v2", "width": 0.25}}, (3, 32, 32), 10),
}
OPTIMIZER_PROBES = ("sgd", "adamw", "lars")
SHARD_SAMPLES = 16


def _spec(fields: dict[str, Any], exactness: str, shards: int, **extra: Any) -> TrainSpec:
    spec = {"dataset": "probe", "global_batch_size": SHARD_SAMPLES * shards, "shards": shards,
            "epochs": 2, "seed": 7, "exactness": exactness, **fields, **extra}
    return TrainSpec.from_job_spec(spec, n_train=SHARD_SAMPLES * shards * 4)


def _data(shape: tuple[int, ...], classes: int, count: int, seed: int) -> tuple[np.ndarray,
                                                                             np.ndarray]:
    rng = np.random.default_rng(seed)  # uniform doubles and integers: the same everywhere
    x = (rng.random((count, *shape)) * 4.0 - 2.0).astype(np.float32)
    return x, rng.integers(0, classes, count)


def _result_bytes(r: ShardResult) -> bytes:
    return (np.ascontiguousarray(r.grad_sum).tobytes() + np.ascontiguousarray(r.stats).tobytes()
            + np.float64(r.loss_sum).tobytes() + int(r.correct).to_bytes(8, "little"))


def shard_digest(name: str, exactness: str, samples: int = SHARD_SAMPLES) -> str:
    """SHA-256 of one shard's result (gradient, statistics, loss, correct count) of probe
    model `name`, from fixed weights and data."""
    fields, shape, classes = PROBES[name]
    spec = _spec(fields, exactness, 1)
    model = build_model(spec.arch, shape, classes, spec.model_options)
    state = initial_state(model, spec)
    x, y = _data(shape, classes, samples, 11)
    r = compute_shard(model, state.params, state.buffers, x, y, spec, 3, 0)
    return hashlib.sha256(_result_bytes(r)).hexdigest()


def steps_digest(optimizer: str, exactness: str, steps: int = 3) -> str:
    """SHA-256 of the parameters after `steps` steps of the cnn probe (4 shards, cosine
    schedule with warmup, weight decay) with `optimizer`: the server's side of a step."""
    fields, shape, classes = PROBES["cnn"]
    spec = _spec(fields, exactness, 4, optimizer={"type": optimizer, "lr": 0.05,
                                                  "weight_decay": 1e-3, "warmup_epochs": 1})
    model = build_model(spec.arch, shape, classes, spec.model_options)
    state = initial_state(model, spec)
    x, y = _data(shape, classes, SHARD_SAMPLES * 4, 13)
    for t in range(steps):
        results = [compute_shard(model, state.params, state.buffers,
                                 x[k * SHARD_SAMPLES:(k + 1) * SHARD_SAMPLES],
                                 y[k * SHARD_SAMPLES:(k + 1) * SHARD_SAMPLES], spec, t, k)
                   for k in range(4)]
        state, _ = apply_step(model, spec, state, results)
    return hashlib.sha256(state.params.tobytes() + state.opt_state.tobytes()
                          + state.buffers.tobytes()).hexdigest()


def digests(exactness: str, models: list[str] | None = None) -> dict[str, str]:
    out = {f"shard:{m}": shard_digest(m, exactness) for m in models or list(PROBES)}
    out.update({f"steps:{o}": steps_digest(o, exactness) for o in OPTIMIZER_PROBES})
    return out


@functools.lru_cache(maxsize=1)
def fingerprint() -> str:
    """What this machine's `class` kernels make of a fixed small shard (16 hex digits)."""
    return shard_digest("cnn", "class", samples=8)[:16]


def _blas() -> dict[str, Any]:
    try:  # optional: the agent runs without it
        import threadpoolctl

        for lib in threadpoolctl.threadpool_info():
            if lib.get("user_api") == "blas":
                return {"library": lib.get("internal_api"), "version": lib.get("version"),
                        "kernel": lib.get("architecture")}
    except Exception:  # noqa: BLE001 - a probe: say nothing rather than fail the agent
        pass
    try:
        deps = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
        return {"library": deps.get("name"), "version": deps.get("version"), "kernel": None}
    except Exception:  # noqa: BLE001
        return {"library": None, "version": None, "kernel": None}


def _simd() -> list[str]:
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as features
    except ImportError:  # numpy 1.x
        try:
            from numpy.core._multiarray_umath import __cpu_features__ as features
        except ImportError:
            return []
    return sorted(name for name, on in features.items() if on)


@functools.lru_cache(maxsize=1)
def describe() -> dict[str, Any]:
    """This machine's compute class: the facts and the fingerprint (the agent's
    `capabilities.compute_class`)."""
    simd = _simd()
    return {"machine": platform.machine(), "numpy": np.__version__, "blas": _blas(),
            "simd": simd[-1] if simd else None, "simd_features": len(simd),
            "fingerprint": fingerprint()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.compute_class", description=__doc__
                                     .split("\n\n")[0])
    parser.add_argument("--digests", action="store_true", help="also the probe digests")
    parser.add_argument("--exactness", default="portable", choices=("portable", "class"))
    parser.add_argument("--models", default=",".join(PROBES),
                        help="comma-separated probe models (default: all)")
    args = parser.parse_args(argv)
    out: dict[str, Any] = {"compute_class": describe()}
    if args.digests:
        out["exactness"] = args.exactness
        out["digests"] = digests(args.exactness, [m for m in args.models.split(",") if m])
    json.dump(out, sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
