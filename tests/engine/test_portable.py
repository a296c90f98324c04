"""The portable compute path: the same bits under every OpenBLAS kernel and numpy SIMD level
this machine runs (ARM64 CPUs: tests/arm64/), and its parts' arithmetic."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest

from engine import portable
from engine.kernels import CLASS, PORTABLE

ROOT = Path(__file__).resolve().parents[2]
# x86 kernels OpenBLAS can be told to use on any x86-64 CPU; SkylakeX needs AVX-512
KERNELS = ["Haswell", "Sandybridge", "Nehalem", "Prescott"]
if "avx512f" in Path("/proc/cpuinfo").read_text():
    KERNELS.append("SkylakeX")
# numpy's SIMD dispatch held back to SSE4.2-level loops (x86-64-v2): other exp/log/sum loops
NO_AVX = ("AVX512F AVX512CD AVX512_SKX AVX512_CLX AVX512_CNL AVX512_ICL AVX512_SPR X86_V4 "
          "AVX2 FMA3 X86_V3")
VARIANTS = [{"OPENBLAS_CORETYPE": k} for k in KERNELS] + [{"NPY_DISABLE_CPU_FEATURES": NO_AVX}]


def _run(argv: list[str], extra_env: dict[str, str]) -> str:
    env = {**os.environ, **extra_env, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(argv, env=env, capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def _digests(exactness: str, extra_env: dict[str, str]) -> dict:
    out = json.loads(_run([sys.executable, "-m", "engine.compute_class", "--digests",
                           "--exactness", exactness], extra_env))
    return out


def test_portable_shards_and_steps_are_the_same_bytes_under_every_kernel_and_simd_level():
    runs = {json.dumps(v): _digests("portable", v) for v in VARIANTS}
    kernels = {r["compute_class"]["blas"]["kernel"] for r in runs.values()}
    assert len(kernels) >= 4, kernels  # the variants really ran other BLAS kernels
    digests = {json.dumps(r["digests"], sort_keys=True) for r in runs.values()}
    assert len(digests) == 1, runs  # mlp, cnn, resnet18, mobilenet_v2 shards; sgd/adamw/lars
    # and the class path, run the same way, does differ: the test can see a difference
    fast = [_digests("class", v) for v in VARIANTS[:3]]
    assert len({json.dumps(r["digests"], sort_keys=True) for r in fast}) == 3
    # and the compute class tells those machines apart
    assert len({r["compute_class"]["fingerprint"] for r in fast}) == 3


SPEC = """name: exact
model: {arch: cnn}
dataset: digits
global_batch_size: 128
shards: 8
epochs: 2
seed: 3
exactness: EXACTNESS
label_smoothing: 0.1
optimizer: {lr: 0.1, momentum: 0.9, weight_decay: 0.0001, warmup_epochs: 1, schedule: cosine}
"""


def test_the_reference_trainer_ends_on_one_hash_under_every_kernel_in_portable(tmp_path):
    def train(exactness: str, env: dict[str, str]) -> dict:
        spec = tmp_path / f"{exactness}.yaml"
        spec.write_text(SPEC.replace("EXACTNESS", exactness))
        phalanx = str(Path(sys.executable).with_name("phalanx"))
        lines = _run([phalanx, "train", "--local", str(spec)], env).splitlines()
        return json.loads(lines[-1])

    # the kernels furthest apart (AVX2 FMA, SSE3) and numpy without AVX: the digests test
    # above covers every variant shard by shard
    portable_runs = [train("portable", v) for v in (VARIANTS[0], VARIANTS[3], VARIANTS[-1])]
    assert len({m["params_sha256"] for m in portable_runs}) == 1, portable_runs
    assert len({m["val_accuracy"] for m in portable_runs}) == 1
    class_runs = [train("class", v) for v in VARIANTS[:2]]
    assert class_runs[0]["params_sha256"] != class_runs[1]["params_sha256"]


def _exact_product(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """What portable.matmul promises: the product of the rounded operands, exactly, then
    rounded once to float32 (Fractions: no float arithmetic at all)."""
    p, q = portable.operand_bits(a.shape[1])
    ai, sa = portable._scaled_integers(a, 1, p)
    bi, sb = portable._scaled_integers(b, 0, q)
    out = np.empty((a.shape[0], b.shape[1]), np.float32)
    for i in range(a.shape[0]):
        for j in range(b.shape[1]):
            total = sum(int(x) * int(y) for x, y in zip(ai[i], bi[:, j]))
            out[i, j] = float(Fraction(total) * Fraction(float(sa[i, 0])) * Fraction(float(sb[0, j])))
    return out


def test_matmul_is_the_exact_product_of_its_rounded_operands_in_any_order():
    rng = np.random.default_rng(5)
    a = (rng.standard_normal((7, 300)) * np.exp(rng.normal(0, 3, (7, 1)))).astype(np.float32)
    b = rng.standard_normal((300, 5)).astype(np.float32)
    a[2] = 0.0  # a row of zeros
    got = portable.matmul(a, b)
    assert np.array_equal(got, _exact_product(a, b))
    perm = rng.permutation(300)  # another summation order: the same bits
    assert np.array_equal(portable.matmul(a[:, perm], b[perm]), got)
    assert np.array_equal(portable.matmul(np.asfortranarray(a), b), got)  # another layout
    # close to the true product: each operand keeps >= 18 bits of its line's largest element
    ref = a.astype(np.float64) @ b.astype(np.float64)
    scale = np.abs(a).max(axis=1, keepdims=True) * np.abs(b).sum(axis=0, keepdims=True)
    assert np.all(np.abs(got - ref) <= 2.0**-17 * scale + 1e-30)


def test_operand_bits_keep_every_sum_below_2_to_the_53():
    for k in (1, 2, 64, 576, 4608, 16384, 200_704):
        p, q = portable.operand_bits(k)
        assert k * 2 ** (p + q) <= 2**53 and p >= 17 and q >= 17
    with pytest.raises(ValueError, match="too long"):
        portable.operand_bits(2**46)


def _pairwise(values: list[float]) -> float:
    """fold's order in plain Python: rows [0, h) + [h, n), the middle one carried up."""
    while len(values) > 1:
        n, h = len(values), (len(values) + 1) // 2
        values = [float(np.float32(values[i]) + np.float32(values[i + h])) for i in range(n - h)] \
            + values[n - h : h]
    return values[0]


def test_fold_adds_in_its_documented_order():
    rng = np.random.default_rng(1)
    for n in (1, 2, 7, 64, 101):
        x = (rng.standard_normal((n, 3)) * 10.0 ** rng.integers(-3, 4, (n, 3))).astype(np.float32)
        got = portable.fold(x, 0)
        want = [_pairwise([float(v) for v in x[:, j]]) for j in range(3)]
        assert np.array_equal(got, np.array(want, np.float32))
    assert portable.fold(np.zeros((0, 4), np.float32)).shape == (4,)


def test_exp_log_cos_powi_match_the_platform_within_a_few_ulp():
    x = np.concatenate([np.linspace(-104, 89, 20001), [-0.0, 1e-30, -1e-12]])
    ours, ref = portable.exp(x), np.exp(x)
    assert np.all(np.abs(ours - ref) <= 4 * np.spacing(ref))
    assert portable.exp(np.array([-800.0, 800.0, np.nan]))[0] == 0.0
    assert np.isinf(portable.exp(np.array([800.0]))[0])
    y = np.concatenate([np.geomspace(1e-38, 3e38, 20001), [1.0, 2.0, 0.5]])
    assert np.all(np.abs(portable.log(y) - np.log(y)) <= 4 * np.spacing(np.abs(np.log(y)) + 1e-300))
    assert portable.log(np.array([1.0]))[0] == 0.0 and portable.log(np.array([0.0]))[0] == -np.inf
    for t in np.linspace(0.0, math.pi, 1001):
        assert abs(portable.cos(float(t)) - math.cos(t)) <= 4e-16
    with pytest.raises(ValueError):
        portable.cos(4.0)
    assert portable.powi(0.5, 10) == 2.0**-10 and portable.powi(0.9, 0) == 1.0
    assert abs(portable.powi(0.999, 1000) / 0.999**1000 - 1.0) <= 1e-13  # ~10 roundings


def test_normal_draws_are_standard_normal_and_a_function_of_the_generator():
    draws = portable.normal(np.random.default_rng(3), (200_000,))
    assert abs(draws.mean()) < 0.01 and abs(draws.std() - 1.0) < 0.01
    assert abs(np.mean(np.abs(draws) > 1.96) - 0.05) < 0.003
    again = portable.normal(np.random.default_rng(3), (200_000,))
    assert np.array_equal(draws, again)


def test_kernel_sets_agree_to_float32_accuracy():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((40, 30)).astype(np.float32)
    w = rng.standard_normal((30, 20)).astype(np.float32)
    np.testing.assert_allclose(PORTABLE.matmul(x, w), CLASS.matmul(x, w), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(PORTABLE.colsum(x), CLASS.colsum(x), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(PORTABLE.exp(x), CLASS.exp(x), rtol=1e-6)
    pos = np.abs(x) + 0.1
    np.testing.assert_allclose(PORTABLE.log(pos), CLASS.log(pos), rtol=1e-6, atol=1e-7)
