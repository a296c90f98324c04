"""The agent's engine needs numpy only: torch is optional, scikit-learn is control-plane only."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120)


def test_the_engine_trains_without_torch_and_says_so_when_torch_is_asked_for():
    out = _run("""
        import sys
        sys.modules["torch"] = None  # as on a phone without python-torch
        import numpy as np
        from engine import torch_backend
        from engine.models import build_model
        from engine.spec import TrainSpec
        from engine.step import compute_shard
        from wire.messages import encode_results
        assert not torch_backend.available()
        m = build_model("cnn", (1, 8, 8), 10, {})
        p, b = m.init(0)
        spec = TrainSpec.from_job_spec({"model": {"arch": "cnn"}, "dataset": "digits",
                                        "exactness": "portable"})
        x, y = np.zeros((4, 1, 8, 8), np.float32), np.arange(4)
        r = compute_shard(m, p, b, x, y, spec, 0, 0)
        encode_results("job-1", 0, [r])
        # a portable job computes with numpy's portable kernels whatever the backend
        again = compute_shard(m, p, b, x, y, spec, 0, 0, backend="torch")
        print("portable ignores torch:", np.array_equal(again.grad_sum, r.grad_sum))
        fast = TrainSpec.from_job_spec({"model": {"arch": "cnn"}, "dataset": "digits",
                                        "exactness": "class"})
        try:
            compute_shard(m, p, b, x, y, fast, 0, 0, backend="torch")
        except RuntimeError as exc:
            print("refused:", exc)
        print("sklearn loaded:", "sklearn" in sys.modules)
    """)
    assert out.returncode == 0, out.stderr
    assert "refused: backend 'torch' needs PyTorch installed" in out.stdout
    assert "portable ignores torch: True" in out.stdout
    assert "sklearn loaded: False" in out.stdout
