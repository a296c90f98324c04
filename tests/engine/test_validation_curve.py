"""The validation curve (engine.validation): `eval_every` in the spec, the reference trainer's
points, and the same points from the cluster's weights of those steps, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest

from api.schemas.jobs import JobCreate
from domain.store.models import StepMetric
from domain.store.states import Event
from engine.jobinfo import job_info
from engine.spec import SpecError, TrainSpec
from engine.validation import validation_due
from phalanx.train_local import run_reference
from scheduler import apply
from scheduler.tasks.recovery import rewind
from tests.api.conftest import api_on
from tests.scheduler.helpers import job, make_ctx, run_to, start_job, tiny_spec


@pytest.mark.parametrize(("every", "total", "due"), [
    (0, 10, []),  # the final metrics only
    (3, 10, [3, 6, 9, 10]),  # and the last step's, whatever the remainder
    (5, 10, [5, 10]),
    (25, 10, [10]),
    (1, 3, [1, 2, 3]),
])
def test_points_every_eval_every_steps_and_the_last(every, total, due) -> None:
    spec = TrainSpec(arch="mlp", dataset="digits", global_batch_size=10, shards=1, epochs=total,
                     eval_every=every, n_train=10)
    assert [n for n in range(total + 1) if validation_due(spec, n)] == due


@pytest.mark.parametrize("bad", [-1, 1.5, "10", True])
def test_a_bad_eval_every_is_refused_by_name(bad) -> None:
    with pytest.raises(SpecError, match="eval_every"):
        TrainSpec.from_job_spec({"model": {"arch": "mlp"}, "dataset": "digits", "eval_every": bad})


def test_the_api_answers_422_naming_eval_every(sqlite_url, tmp_path: Path) -> None:
    spec = {"name": "j", "model": {"arch": "logreg"}, "dataset": "digits"}
    with api_on(sqlite_url, tmp_path) as api:
        for bad in (-1, 100_001, "often"):
            got = api.post("/v1/jobs", json={**spec, "eval_every": bad})
            assert got.status_code == 422, got.text
            assert [e["loc"][-1] for e in got.json()["detail"]] == ["eval_every"], got.text
    assert JobCreate.model_validate({**spec, "eval_every": 10}).spec()["eval_every"] == 10
    assert JobCreate.model_validate(spec).spec()["eval_every"] == 0  # kept with its default


@pytest.mark.parametrize("slices", [1, 3], ids=["whole", "sliced"])
def test_the_cluster_commits_the_reference_curve_bit_for_bit(sqlite_url, tmp_path: Path,
                                                             slices: int) -> None:
    spec = tiny_spec(eval_every=3, slices=slices, checkpoint_every=100)  # 8 steps: 3, 6, 8
    reference = run_reference(spec, None, progress=False)
    assert [p["step"] for p in reference["validation"]] == [2, 5, 7]
    last = reference["validation"][-1]
    assert (last["val_loss"], last["val_accuracy"]) == (reference["val_loss"],
                                                        reference["val_accuracy"])
    ctx = make_ctx(sqlite_url, tmp_path, slices_inline=True)
    job_id = start_job(ctx, spec)
    run_to(ctx, job_id, 4)
    running = job(ctx, job_id)  # the latest point in the running job's metrics
    assert (running.metrics["val_loss"], running.metrics["val_accuracy"]) == (
        reference["validation"][0]["val_loss"], reference["validation"][0]["val_accuracy"])
    run_to(ctx, job_id, job(ctx, job_id).total_steps)
    done = job(ctx, job_id)
    assert done.state == "Succeeded"
    with ctx.session_factory() as session:
        rows = session.query(StepMetric).filter(StepMetric.job_id == job_id).order_by(
            StepMetric.step).all()
    assert [r.step for r in rows] == list(range(8))
    assert [{"step": r.step, "val_loss": r.val_loss, "val_accuracy": r.val_accuracy}
            for r in rows if r.val_loss is not None] == reference["validation"]
    assert all(r.val_accuracy is None for r in rows if r.val_loss is None)
    assert (done.metrics["val_loss"], done.metrics["val_accuracy"]) == (
        reference["val_loss"], reference["val_accuracy"])


def test_without_eval_every_only_the_final_weights_are_validated(sqlite_url, tmp_path: Path
                                                                 ) -> None:
    ctx = make_ctx(sqlite_url, tmp_path)
    job_id = start_job(ctx, tiny_spec())
    run_to(ctx, job_id, job(ctx, job_id).total_steps)
    with ctx.session_factory() as session:
        assert session.query(StepMetric).filter(StepMetric.job_id == job_id,
                                                StepMetric.val_loss.is_not(None)).count() == 0
    assert job(ctx, job_id).metrics["val_accuracy"] > 0


def test_a_rewound_job_forgets_its_undone_point_and_ends_on_the_reference_curve(
        sqlite_url, tmp_path: Path) -> None:
    spec = tiny_spec(eval_every=2, checkpoint_every=2)  # points of steps 2, 4, 6, 8
    reference = run_reference(spec, None, progress=False)
    ctx = make_ctx(sqlite_url, tmp_path)
    job_id = start_job(ctx, spec)
    run_to(ctx, job_id, 5)
    assert job(ctx, job_id).metrics["val_accuracy"] == reference["validation"][1]["val_accuracy"]
    info = job_info(job_id, spec, ctx.settings.data_dir)
    assert rewind(ctx, job(ctx, job_id), info, 3, Event("RewoundForAudit", "a test")) is not None
    back = job(ctx, job_id)
    assert back.step == 2 and "val_accuracy" not in back.metrics  # step 4's weights are undone
    run_to(ctx, job_id, back.total_steps)
    with ctx.session_factory() as session:
        rows = session.query(StepMetric).filter(StepMetric.job_id == job_id,
                                                StepMetric.val_loss.is_not(None)).order_by(
            StepMetric.step).all()
    assert [{"step": r.step, "val_loss": r.val_loss, "val_accuracy": r.val_accuracy}
            for r in rows] == reference["validation"]


def test_a_point_is_measured_after_its_step_commits_and_the_last_one_before(
        sqlite_url, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The phones need not wait for a validation: step t+1's work is out before a point of
    t is measured; only the final point, part of the job's result, comes before its commit."""
    spec = tiny_spec(eval_every=3)  # points of steps 3, 6 and 8 (the last)
    ctx = make_ctx(sqlite_url, tmp_path)
    job_id = start_job(ctx, spec)
    seen: list[tuple[int, int]] = []  # (the state's steps, the job's step when measured)
    real = apply.validate

    def watching(info, state, x, y):
        seen.append((state.step, job(ctx, job_id).step))
        return real(info, state, x, y)

    monkeypatch.setattr(apply, "validate", watching)
    run_to(ctx, job_id, job(ctx, job_id).total_steps)
    assert seen == [(3, 3), (6, 6), (8, 7)]
