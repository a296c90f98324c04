"""A sliced job's steps (scheduler.tasks.slices, scheduler.apply) against a real database and both hot-state
stores: the same run as the reference bit for bit, a slice applied again alone, a lost result
replanned, lost hot state restored slice by slice, one commit whoever finishes last."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import func, select

from api.steps.protocol import BadSlice, NotYetApplied, StaleStep, StepProtocol
from domain.store.models import StepMetric
from engine.jobinfo import job_info
from hotstate import keys
from hotstate.sliceplan import SlicePlan
from phalanx.train_local import run_reference
from scheduler import apply
from scheduler.tasks import slices as sliced
from scheduler.tasks.reconcile import run_reconcile_job
from scheduler.tasks.steps import run_apply_step
from tests.engine.test_layerspec import EVERY_LAYER
from tests.scheduler.helpers import (
    assignments,
    job,
    run_to,
    start_job,
    store_param_ctx,
    stored_state,
    tiny_spec,
    upload_all,
)
from wire.messages import join_weights


@pytest.fixture(params=["memory", "redis"])
def ctx(request: pytest.FixtureRequest, db_url: str, tmp_path: Path):
    """Every slice applied by the task that starts the step, one after another."""
    return store_param_ctx(request, db_url, tmp_path, slices_inline=True)


@pytest.fixture(params=["memory", "redis"])
def sending_ctx(request: pytest.FixtureRequest, db_url: str, tmp_path: Path):
    """Slices sent to the workers, as deployed (the test plays the workers)."""
    return store_param_ctx(request, db_url, tmp_path)


def slice_keys(ctx, job_id: str, step: int) -> list[str]:
    return sorted(ctx.blobs.keys(f"job:{job_id}:state:{step}:"))


@pytest.mark.parametrize("change", [
    {"slices": 3},
    {"slices": 4, "model": {"layers": EVERY_LAYER}},  # BN buffers ride in slice 0
    {"slices": 2, "optimizer": {"type": "lars", "lr": 2.0, "trust_coefficient": 0.02}},
    {"slices": 3, "optimizer": {"type": "adamw", "lr": 0.01, "weight_decay": 0.05},
     "upload_precision": "bfloat16"},
], ids=["sgd", "own-layer-graph", "lars", "adamw-bfloat16"])
def test_a_sliced_run_is_the_reference_bit_for_bit(ctx, change) -> None:
    spec = {**tiny_spec(), **change}
    job_id = start_job(ctx, spec)
    assert len(slice_keys(ctx, job_id, 0)) == spec["slices"]  # the state lives in slices
    run_to(ctx, job_id, job(ctx, job_id).total_steps)
    done = job(ctx, job_id)
    ref = run_reference(spec, None, progress=False)
    assert done.state == "Succeeded"
    assert done.metrics["params_sha256"] == ref["params_sha256"]
    assert abs(done.metrics["train_loss"] - ref["train_loss"]) / ref["train_loss"] < 1e-5


def test_slices_go_to_the_workers_and_a_lost_one_is_applied_again_alone(sending_ctx,
                                                                       monkeypatch) -> None:
    ctx = sending_ctx
    spec = tiny_spec(slices=3)
    job_id = start_job(ctx, spec)
    sent: list[tuple[str, int, int]] = []
    monkeypatch.setattr(sliced, "send_slice", lambda *task: sent.append(task))
    upload_all(ctx, job_id, 0)
    # the step's task applies one slice and sends the others: not committed until they are
    assert run_apply_step(ctx, job_id, 0) == "applied"
    assert sorted(sent) == [(job_id, 0, 1), (job_id, 0, 2)] and job(ctx, job_id).step == 0
    nonce0 = job(ctx, job_id).state_nonce
    plan = SlicePlan.decode(ctx.blobs.get(keys.slice_plan(job_id, 0, nonce0)))
    assert ctx.blobs.exists(keys.slice_done(job_id, 0, plan.nonce, 0))
    # a worker applies slice 1; slice 2's task is lost (its worker died before running it)
    assert sliced.run_apply_slice(ctx, job_id, 0, 1) == "applied"
    assert job(ctx, job_id).step == 0
    # the claim expires; the step's task runs again (reconcile) and sends only slice 2
    applied: list[int] = []
    real = sliced.run_apply_slice
    monkeypatch.setattr(sliced, "run_apply_slice",
                        lambda c, j, t, i, *rest: applied.append(i) or real(c, j, t, i, *rest))
    ctx.blobs.delete(keys.slice_claim(job_id, 0, plan.nonce, 2))
    sent.clear()
    assert run_apply_step(ctx, job_id, 0) == "applied"
    assert applied == [2] and sent == []  # the one slice left, applied here: it commits
    assert job(ctx, job_id).step == 1
    # a slice task delivered twice (late) changes nothing
    assert sliced.run_apply_slice(ctx, job_id, 0, 1) == "stale"
    # the rest of the run, as deployed, equals the reference
    monkeypatch.setattr(sliced, "run_apply_slice", real)
    while job(ctx, job_id).state == "Running":
        t = job(ctx, job_id).step
        upload_all(ctx, job_id, t)
        sent.clear()
        run_apply_step(ctx, job_id, t)
        for _, step, index in sent:
            sliced.run_apply_slice(ctx, job_id, step, index)
    ref = run_reference(spec, None, progress=False)
    assert job(ctx, job_id).metrics["params_sha256"] == ref["params_sha256"]


def test_a_step_whose_slices_finish_together_commits_once(sending_ctx, monkeypatch) -> None:
    ctx = sending_ctx
    job_id = start_job(ctx, tiny_spec(slices=2))
    monkeypatch.setattr(sliced, "send_slice", lambda *task: None)
    upload_all(ctx, job_id, 0)
    run_apply_step(ctx, job_id, 0)  # slice 0 stored
    assert sliced.run_apply_slice(ctx, job_id, 0, 1) == "applied"  # slice 1: it commits
    # the task of slice 0 ran again after dying between its store and its commit check
    assert sliced.run_apply_slice(ctx, job_id, 0, 0) == "stale"
    assert job(ctx, job_id).step == 1
    with ctx.session_factory() as s:  # one row of metrics for the step: committed once
        assert s.scalar(select(func.count()).select_from(StepMetric)
                        .where(StepMetric.job_id == job_id)) == 1


def test_a_lost_result_replans_the_step_under_a_new_nonce(sending_ctx, monkeypatch) -> None:
    ctx = sending_ctx
    spec = tiny_spec(slices=2)
    job_id = start_job(ctx, spec)
    monkeypatch.setattr(sliced, "send_slice", lambda *task: None)
    upload_all(ctx, job_id, 0)
    run_apply_step(ctx, job_id, 0)  # slice 0 stored under the first plan
    nonce0 = job(ctx, job_id).state_nonce
    first = SlicePlan.decode(ctx.blobs.get(keys.slice_plan(job_id, 0, nonce0)))
    ctx.blobs.delete(keys.grad(job_id, 0, 2))  # shard 2's result is gone (its replica died)
    assert sliced.run_apply_slice(ctx, job_id, 0, 1) == "incomplete"
    assert ctx.blobs.get(keys.slice_plan(job_id, 0, nonce0)) is None
    assert job(ctx, job_id).step == 0  # never a step with a result missing
    upload_all(ctx, job_id, 0, shards=[2])  # the device uploads it again
    monkeypatch.setattr(ctx.tuning, "slices_inline", True)
    assert run_apply_step(ctx, job_id, 0) == "applied"
    row = job(ctx, job_id)
    assert row.step == 1 and row.state_nonce != first.nonce  # the new plan's slices
    run_to(ctx, job_id, row.total_steps)
    assert job(ctx, job_id).metrics["params_sha256"] == run_reference(
        spec, None, progress=False)["params_sha256"]


def test_lost_hot_state_is_restored_in_slices_from_the_checkpoint(ctx) -> None:
    spec = tiny_spec(slices=3)
    job_id = start_job(ctx, spec)
    run_to(ctx, job_id, 4)  # checkpoint_every 3: a checkpoint of step 3
    whole = stored_state(ctx, job_id, 4)
    ctx.blobs.flush()
    assert run_reconcile_job(ctx, job_id) == "restored"
    assert job(ctx, job_id).step == 3 and len(slice_keys(ctx, job_id, 3)) == 3
    run_to(ctx, job_id, 4)
    again = stored_state(ctx, job_id, 4)
    assert np.array_equal(again.params, whole.params)
    assert np.array_equal(again.opt_state, whole.opt_state)


def test_a_slice_of_the_next_step_is_served_once_applied_and_names_its_state(sending_ctx,
                                                                           monkeypatch) -> None:
    ctx = sending_ctx
    job_id = start_job(ctx, tiny_spec(slices=3))
    proto = StepProtocol(ctx.session_factory, ctx.blobs, ctx.settings.data_dir, ctx.clock)
    device = assignments(ctx, job_id)[0][1]
    assert proto.work(device).slices == [list(b) for b in job_info(
        job_id, job(ctx, job_id).spec, ctx.settings.data_dir).slices]
    monkeypatch.setattr(sliced, "send_slice", lambda *task: None)
    upload_all(ctx, job_id, 0)
    run_apply_step(ctx, job_id, 0)  # slice 0 of step 1 stored; 1 and 2 not yet
    nonce0 = job(ctx, job_id).state_nonce
    plan = SlicePlan.decode(ctx.blobs.get(keys.slice_plan(job_id, 0, nonce0)))
    early, state, ahead = proto.weights(device, job_id, 1, part=0)
    assert state == plan.nonce and ahead  # served before step 1 commits, naming its state
    with pytest.raises(NotYetApplied, match="slice 1 of step 1 is not applied yet"):
        proto.weights(device, job_id, 1, part=1)
    with pytest.raises(BadSlice, match="has 3 slice"):
        proto.weights(device, job_id, 1, part=3)
    with pytest.raises(StaleStep):
        proto.weights(device, job_id, 2, part=0)  # two steps ahead: not planned
    for index in (1, 2):
        sliced.run_apply_slice(ctx, job_id, 0, index)
    row = job(ctx, job_id)
    assert row.step == 1 and row.state_nonce == plan.nonce  # the state it named committed
    assert proto.work(device).state == plan.nonce
    parts = [proto.weights(device, job_id, 1, part=k) for k in range(3)]
    assert bytes(parts[0][0]) == bytes(early) and not any(p[2] for p in parts)
    whole, state, _ = proto.weights(device, job_id, 1)
    assert b"".join(join_weights(job_id, 1, [p[0] for p in parts])) == bytes(whole)
    assert state == plan.nonce


def test_a_slice_state_lost_alone_is_applied_again_and_never_committed_half(sending_ctx,
                                                                           monkeypatch) -> None:
    ctx = sending_ctx
    spec = tiny_spec(slices=3)
    job_id = start_job(ctx, spec)
    monkeypatch.setattr(sliced, "send_slice", lambda *task: None)
    upload_all(ctx, job_id, 0)
    run_apply_step(ctx, job_id, 0)  # slice 0
    assert sliced.run_apply_slice(ctx, job_id, 0, 1) == "applied"
    plan = SlicePlan.decode(ctx.blobs.get(keys.slice_plan(
        job_id, 0, job(ctx, job_id).state_nonce)))
    ctx.blobs.delete(keys.state_slice(job_id, 1, plan.nonce, 1))  # slice 1's state lost alone
    assert sliced.run_apply_slice(ctx, job_id, 0, 2) == "incomplete"  # every mark, not every key
    assert job(ctx, job_id).step == 0  # never a step with a slice missing
    assert run_apply_step(ctx, job_id, 0) == "applied"  # reconcile's resend: slice 1 again
    assert job(ctx, job_id).step == 1
    # a committed state that loses one slice is restored, not served half: phones get no work
    # until reconcile brings it back from the checkpoint (or the seeded init) in whole
    row = job(ctx, job_id)
    ctx.blobs.delete(keys.state_slice(job_id, 1, row.state_nonce, 2))
    proto = StepProtocol(ctx.session_factory, ctx.blobs, ctx.settings.data_dir, ctx.clock)
    assert proto.work(assignments(ctx, job_id)[0][1]) is None
    assert run_reconcile_job(ctx, job_id) == "restored"
    assert job(ctx, job_id).step == 0 and len(slice_keys(ctx, job_id, 0)) == 3
    monkeypatch.setattr(ctx.tuning, "slices_inline", True)
    run_to(ctx, job_id, job(ctx, job_id).total_steps)
    assert job(ctx, job_id).metrics["params_sha256"] == run_reference(
        spec, None, progress=False)["params_sha256"]


def test_a_late_task_of_an_abandoned_plan_deletes_neither_the_new_plan_nor_its_results(
        sending_ctx, monkeypatch) -> None:
    ctx = sending_ctx
    job_id = start_job(ctx, tiny_spec(slices=2))
    monkeypatch.setattr(sliced, "send_slice", lambda *task: None)
    upload_all(ctx, job_id, 0)
    run_apply_step(ctx, job_id, 0)
    row = job(ctx, job_id)
    old = SlicePlan.decode(ctx.blobs.get(keys.slice_plan(job_id, 0, row.state_nonce)))
    ctx.blobs.delete(keys.grad(job_id, 0, 3))  # shard 3 lost: the plan goes
    assert sliced.run_apply_slice(ctx, job_id, 0, 1) == "incomplete"
    upload_all(ctx, job_id, 0, shards=[3])  # uploaded again; the step is planned afresh
    run_apply_step(ctx, job_id, 0)
    new = ctx.blobs.get(keys.slice_plan(job_id, 0, row.state_nonce))
    assert new is not None and SlicePlan.decode(new) != old
    # a task still holding the old plan now fails to fetch a body (a replica timed out)
    monkeypatch.setattr(apply, "fetch_pieces", lambda blobs, pieces: dict.fromkeys(pieces))
    info = job_info(job_id, row.spec, ctx.settings.data_dir)
    assert apply.read_results(ctx, row, info, old, 1) is None
    assert ctx.blobs.get(keys.slice_plan(job_id, 0, row.state_nonce)) == new  # kept


def test_a_commit_whose_task_died_is_made_by_the_next_run_from_the_marks(sending_ctx,
                                                                        monkeypatch) -> None:
    ctx = sending_ctx
    job_id = start_job(ctx, tiny_spec(slices=2))
    monkeypatch.setattr(sliced, "send_slice", lambda *task: None)
    upload_all(ctx, job_id, 0)
    run_apply_step(ctx, job_id, 0)  # slice 0
    real = apply.commit_rows

    def dies(*args, **kwargs):
        raise RuntimeError("worker lost mid-commit")

    monkeypatch.setattr(apply, "commit_rows", dies)
    with pytest.raises(RuntimeError):
        sliced.run_apply_slice(ctx, job_id, 0, 1)  # the last slice: stored, marked, commit dies
    monkeypatch.setattr(apply, "commit_rows", real)
    ctx.blobs.delete(*ctx.blobs.keys(f"job:{job_id}:grad:0:"))  # the results may be gone too
    assert run_apply_step(ctx, job_id, 0) == "applied"  # reconcile's resend: commits
    assert job(ctx, job_id).step == 1
    with ctx.session_factory() as s:
        row = s.scalars(select(StepMetric).where(StepMetric.job_id == job_id)).one()
        assert row.step == 0 and row.samples == 16 and np.isfinite(row.train_loss)
