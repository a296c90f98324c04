"""Every spec in examples/ is one the server accepts as it is (docs/getting-started.md
submits them)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from engine.models import ARCHS, CUSTOM

EXAMPLES = sorted((Path(__file__).resolve().parents[2] / "examples").glob("*.yaml"))


def test_there_is_an_example_for_every_built_in_model_and_an_own_layer_graph() -> None:
    archs = {yaml.safe_load(p.read_text())["model"].get("arch", CUSTOM) for p in EXAMPLES}
    assert archs == {*ARCHS, CUSTOM}


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.stem for p in EXAMPLES])
def test_the_server_accepts_the_example(api, path: Path) -> None:
    submitted = api.post("/v1/jobs", json=yaml.safe_load(path.read_text()))
    assert submitted.status_code == 201, submitted.text
    assert submitted.json()["state"] == "Pending" and submitted.json()["total_steps"] > 0
