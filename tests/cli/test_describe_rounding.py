"""phalanx jobs describe shows a job's metrics rounded to what matters; -o json keeps them."""

from __future__ import annotations

import yaml

from phalanx.cli.user_cmds import describe_job


def test_a_jobs_metrics_read_rounded() -> None:
    job = {"id": "job-1", "metrics": {"train_loss": 0.025984847386877497,
                                      "val_accuracy": 0.9860724233983287, "steps": 100,
                                      "seconds": 1234.5678, "params_sha256": "ab12"}}
    text = describe_job(job)
    assert "train_loss: 0.026\n" in text and "val_accuracy: 98.61%\n" in text
    assert yaml.safe_load(text)["metrics"] == {"train_loss": 0.026, "val_accuracy": "98.61%",
                                               "steps": 100, "seconds": 1235,
                                               "params_sha256": "ab12"}
    assert describe_job({"id": "job-2"}) == "id: job-2\n"
