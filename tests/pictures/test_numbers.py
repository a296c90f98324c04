"""Numbers as a person reads them (pictures.numbers): the issue's 17-digit loss and accuracy."""

from __future__ import annotations

import pytest

from pictures.numbers import metric, percent, significant


@pytest.mark.parametrize(("value", "shown"), [
    (0.025984847386877497, "0.0260"), (1.6234, "1.62"), (12.345, "12.3"), (123.4, "123"),
    (1234.5, "1,234"), (99.96, "100"), (0.1, "0.100"), (-0.5, "-0.500"), (0.0, "0"),
    (0.00012345, "0.000123"), (2.6e-5, "2.60e-05"), (float("nan"), "nan"),
])
def test_three_significant_digits(value, shown) -> None:
    assert significant(value) == shown


def test_accuracy_as_a_percentage_and_metrics_by_name() -> None:
    assert percent(0.9860724233983287) == "98.61%"
    assert metric("val_accuracy", 0.9860724233983287) == "98.61%"
    assert metric("train_loss", 0.025984847386877497) == "0.0260"
    assert metric("steps", 100) == 100 and metric("params_sha256", "ab") == "ab"
    assert metric("converged", True) is True
