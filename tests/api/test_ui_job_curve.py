"""/ui's job page thins a long curve (every k-th step past CURVE_POINTS) but keeps every
validation point, the last step, and the energy of the steps it leaves out."""

from __future__ import annotations

import pytest

from api.routes.ui import CURVE_POINTS, _thinned


def test_a_long_curve_keeps_its_validation_points_last_step_and_energy() -> None:
    n = 3 * CURVE_POINTS + 7
    rows = [{"step": s, "energy_j": 0.5, "val_loss": 1.0 if s % 997 == 0 else None,
             "val_accuracy": None} for s in range(n)]
    kept = _thinned(rows)
    steps = [r["step"] for r in kept]
    assert steps == sorted(set(range(0, n, 3)) | set(range(0, n, 997)) | {n - 1})
    assert sum(r["energy_j"] for r in kept) == pytest.approx(0.5 * n)
    assert _thinned(rows[:10]) == rows[:10]  # a short curve: as it is
