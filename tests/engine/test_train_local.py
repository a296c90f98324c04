"""The reference trainer and `phalanx train --local`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import typer
import yaml
from typer.testing import CliRunner

from engine.checkpoint import load_npz, state_from_arrays
from engine.models import build_model
from phalanx.cli import train_cmd
from phalanx.train_local import run_reference
from tests.support.optional import require

DESIGN_SPEC = {
    "name": "digits-cnn", "model": {"arch": "cnn"}, "dataset": "digits",
    "global_batch_size": 256, "shards": 16, "epochs": 20, "seed": 0,
    "optimizer": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.0001, "warmup_epochs": 2,
                  "schedule": "cosine"},
    "placement": {"min_devices": 1, "max_devices": 8, "selector": {"rack": "a"},
                  "min_battery": 20, "max_temp_c": 45},
}
SMALL = {"name": "mlp", "model": {"arch": "mlp", "hidden": 32, "dropout": 0.2},
         "dataset": "digits", "global_batch_size": 64, "shards": 4, "epochs": 2, "seed": 3}


def _cli():
    app = typer.Typer()
    train_cmd.register(app)
    app.command("noop")(lambda: None)  # two commands: typer keeps `train` as a subcommand
    return app


def test_the_design_cnn_spec_reaches_97_percent_and_writes_a_checkpoint(tmp_path):
    spec = tmp_path / "cnn.json"
    spec.write_text(json.dumps(DESIGN_SPEC))
    result = CliRunner().invoke(_cli(), ["train", "--local", str(spec), "--out",
                                         str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    metrics = json.loads(result.output.strip().splitlines()[-1])
    assert metrics["val_accuracy"] >= 0.97
    assert metrics["steps"] == 100 and metrics["train_loss"] < 0.2 and metrics["seconds"] > 0
    assert "epoch" in result.output  # the per-epoch table
    arrays = load_npz((tmp_path / "out" / "checkpoint.npz").read_bytes())
    model = build_model("cnn", (1, 8, 8), 10, {})
    state = state_from_arrays(model, arrays)
    assert state.step == 100 and arrays["conv1.weight"].shape == (32, 1, 3, 3)
    assert json.loads((tmp_path / "out" / "metrics.json").read_text()) == metrics


def test_two_runs_with_one_seed_are_bit_identical_and_another_seed_differs(tmp_path):
    a = run_reference(SMALL, tmp_path / "a", progress=False)
    b = run_reference(SMALL, tmp_path / "b", progress=False)
    c = run_reference({**SMALL, "seed": 4}, None, progress=False)
    assert a["params_sha256"] == b["params_sha256"] != c["params_sha256"]
    assert a["train_loss"] == b["train_loss"]
    assert (tmp_path / "a" / "checkpoint.npz").read_bytes() == (
        tmp_path / "b" / "checkpoint.npz").read_bytes()


def test_the_torch_backend_ends_at_the_same_loss():
    require("torch")
    spec = {**SMALL, "model": {"arch": "resnet", "width": 0.25}, "epochs": 1}
    a = run_reference(spec, None, progress=False)
    b = run_reference(spec, None, progress=False, backend="torch")
    assert abs(a["train_loss"] - b["train_loss"]) <= 1e-5 * abs(a["train_loss"])


def test_a_yaml_spec_runs_and_the_last_line_is_the_metrics(tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump({**SMALL, "model": {"arch": "logreg"}, "epochs": 1}))
    result = CliRunner().invoke(_cli(), ["train", "--local", str(spec), "--quiet"])
    assert result.exit_code == 0, result.output
    metrics = json.loads(result.output.strip().splitlines()[-1])
    assert set(metrics) >= {"train_loss", "val_accuracy", "steps", "seconds"}
    assert np.isfinite(metrics["train_loss"])


@pytest.mark.parametrize(("spec", "needle"), [
    ({**SMALL, "dataset": "nope"}, "unknown dataset 'nope'"),
    ({**SMALL, "global_batch_size": 63}, "multiple of shards"),
    ({**SMALL, "model": {"arch": "vgg"}}, "unknown arch"),
])
def test_bad_specs_exit_with_the_reason(tmp_path, spec, needle):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(spec))
    result = CliRunner().invoke(_cli(), ["train", "--local", str(path), "--quiet"])
    assert result.exit_code == 2 and needle in result.output


def test_the_design_cnn_spec_reaches_97_percent_in_portable_too():
    from phalanx.train_local import run_reference

    metrics = run_reference({**DESIGN_SPEC, "exactness": "portable"}, None, progress=False)
    assert metrics["val_accuracy"] >= 0.97 and metrics["steps"] == 100
