"""Reconcile and apply_step against a real database: twice equals once, vanished entities,
lost hot state, elastic moves. Tasks are called directly (the Celery wrapper only times them)."""

from __future__ import annotations

import datetime as dt
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from sqlalchemy import func, select

from domain.store.db import transaction
from domain.store.models import Event, Job, StepMetric, TelemetrySample
from engine.jobinfo import job_info
from engine.step import apply_step as engine_apply_step
from engine.step import initial_state
from hotstate import keys
from hotstate.recent import RECENT
from hotstate.trainstate import decode_state
from phalanx.train_local import run_reference
from scheduler import apply
from scheduler.tasks import reconcile, recovery
from scheduler.tasks.reconcile import run_reconcile, run_reconcile_job
from scheduler.tasks.steps import run_apply_step
from tests.engine.test_layerspec import EVERY_LAYER
from tests.scheduler.helpers import (
    Clock,
    add_devices,
    assignments,
    event_reasons,
    job,
    run_to,
    set_device,
    shard_result_blobs,
    start_job,
    state_key,
    store_param_ctx,
    stored_state,
    submit,
    tiny_spec,
    upload_all,
)
from wire.messages import decode_results, encode_results


@pytest.fixture(params=["memory", "redis"])
def ctx(request: pytest.FixtureRequest, db_url: str, tmp_path: Path):
    """Every task test on both hot-state stores (in-process and Redis) and both databases."""
    return store_param_ctx(request, db_url, tmp_path)


def test_placement_twice_equals_once(ctx) -> None:
    add_devices(ctx, 3)
    job_id = submit(ctx, tiny_spec())
    run_reconcile(ctx)
    first = assignments(ctx, job_id)
    run_reconcile(ctx)
    assert assignments(ctx, job_id) == first
    assert sorted(s for s, _, _ in first) == [0, 1, 2, 3]
    assert event_reasons(ctx, job_id).count("Scheduled") == 1
    assert job(ctx, job_id).state == "Running"


def test_tasks_for_a_vanished_job_return_quietly(ctx) -> None:
    assert run_reconcile_job(ctx, "job-gone") == "gone"
    assert run_apply_step(ctx, "job-gone", 0) == "gone"


def test_apply_step_twice_equals_once(ctx) -> None:
    job_id = start_job(ctx)
    upload_all(ctx, job_id, 0)
    state0 = stored_state(ctx, job_id, 0)
    results = [r for b in shard_result_blobs(ctx, job_id, 0).values() for r in decode_results(b)]
    assert run_apply_step(ctx, job_id, 0) == "applied"
    stored = ctx.blobs.get(state_key(ctx, job_id, 1))
    assert run_apply_step(ctx, job_id, 0) == "stale"
    assert ctx.blobs.get(state_key(ctx, job_id, 1)) == stored
    assert job(ctx, job_id).step == 1
    with ctx.session_factory() as s:
        assert s.scalar(select(func.count()).select_from(StepMetric)) == 1
    # the applied step's keys are gone with it: results, their bodies, their count
    assert not [k for k in ctx.blobs.keys(keys.job_prefix(job_id)) if keys.step_of_key(k) == 0]
    assert ctx.blobs.get(keys.covered(job_id, 0)) is None
    # the stored step is exactly the engine's step on the same results, in any order
    info = job_info(job_id, job(ctx, job_id).spec, ctx.settings.data_dir)
    expected, _ = engine_apply_step(info.model, info.spec, state0, list(reversed(results)))
    assert np.array_equal(decode_state(stored).params, expected.params)


class Crash(Exception):
    pass


def test_a_crash_between_state_write_and_commit_is_recomputed(ctx, monkeypatch) -> None:
    job_id = start_job(ctx)
    upload_all(ctx, job_id, 0)

    def crash(*args, **kwargs):
        raise Crash("worker killed before the commit")

    monkeypatch.setattr(apply, "commit_rows", crash)
    with pytest.raises(Crash):
        run_apply_step(ctx, job_id, 0)
    (unnamed,) = ctx.blobs.keys(f"job:{job_id}:state:1:")  # written, named by no row
    written = ctx.blobs.get(unnamed)
    assert written is not None and job(ctx, job_id).step == 0
    monkeypatch.undo()
    assert run_apply_step(ctx, job_id, 0) == "applied"
    assert ctx.blobs.get(state_key(ctx, job_id, 1)) == written  # recomputed: the same bytes
    assert job(ctx, job_id).step == 1


def test_an_applier_that_loses_the_commit_is_never_read_whatever_it_wrote(ctx, monkeypatch) -> None:
    """A slow applier (its claim expired) computed step 1 before a shard's result was recomputed
    with other bytes (another phone, another backend); a second applier computes from the new
    result and commits first. The slow one writes its state after that commit and loses its
    own: the job reads the winner's state, and the loser's is gone."""
    job_id = start_job(ctx)
    blobs = shard_result_blobs(ctx, job_id, 0)
    upload_all(ctx, job_id, 0, blobs=blobs)
    computed: dict[str, np.ndarray] = {}
    slow_done, winner_committed = threading.Event(), threading.Event()
    real = apply.engine_apply_step

    def applying(*args, **kwargs):
        new_state, metrics = real(*args, **kwargs)
        who = threading.current_thread().name
        computed[who] = np.array(new_state.params, copy=True)
        if who == "slow":  # computed; writes and commits only after the other committed
            slow_done.set()
            assert winner_committed.wait(30)
        return new_state, metrics

    monkeypatch.setattr(apply, "engine_apply_step", applying)
    outcome: dict[str, str] = {}
    slow = threading.Thread(name="slow", target=lambda: outcome.update(
        slow=run_apply_step(ctx, job_id, 0)))
    slow.start()
    assert slow_done.wait(30)
    (first,) = decode_results(blobs[0])  # shard 0 again, rounded differently elsewhere
    other = encode_results(job_id, 0, [replace(first, grad_sum=first.grad_sum * np.float32(1.001))])
    ctx.blobs.delete(keys.grad(job_id, 0, 0))
    upload_all(ctx, job_id, 0, shards=[0], blobs={0: other})
    assert run_apply_step(ctx, job_id, 0) == "applied"  # this thread: the winner
    winner_committed.set()
    slow.join(30)
    assert outcome["slow"] == "stale" and job(ctx, job_id).step == 1
    assert not np.array_equal(computed["slow"], computed["MainThread"])
    named = decode_state(ctx.blobs.get(state_key(ctx, job_id, 1)), expect_step=1)
    assert np.array_equal(named.params, computed["MainThread"])
    assert ctx.blobs.keys(f"job:{job_id}:state:1:") == [state_key(ctx, job_id, 1)]


@pytest.mark.parametrize("change", [
    {},
    {"model": {"layers": EVERY_LAYER}},  # a user's own graph, every kind of layer in it
    {"optimizer": {"type": "adamw", "lr": 0.01, "weight_decay": 0.05}},
    {"optimizer": {"type": "lars", "lr": 2.0, "trust_coefficient": 0.02, "nesterov": True},
     "label_smoothing": 0.1, "augment": {"crop_padding": 1, "horizontal_flip": True}},
    {"upload_precision": "bfloat16"},
], ids=["sgd", "own-layer-graph", "adamw", "lars+label-smoothing+augment", "bfloat16-uploads"])
def test_a_whole_run_matches_the_reference_trainer(ctx, tmp_path: Path, change) -> None:
    spec = {**tiny_spec(), **change}
    job_id = start_job(ctx, spec)
    run_to(ctx, job_id, job(ctx, job_id).total_steps)
    done = job(ctx, job_id)
    assert done.state == "Succeeded" and assignments(ctx, job_id) == []
    ref = run_reference(spec, None, progress=False)
    assert abs(done.metrics["train_loss"] - ref["train_loss"]) / ref["train_loss"] < 1e-5
    assert done.metrics["val_accuracy"] == pytest.approx(ref["val_accuracy"])
    assert done.metrics["params_sha256"] == ref["params_sha256"]


def test_lost_hot_state_resumes_from_the_last_checkpoint(ctx) -> None:
    job_id = start_job(ctx)
    run_to(ctx, job_id, 5)  # checkpoint_every 3: a checkpoint of step 3
    before = decode_state(ctx.blobs.get(state_key(ctx, job_id, 5)))
    ctx.blobs.flush()
    assert run_reconcile_job(ctx, job_id) == "restored"
    assert job(ctx, job_id).step == 3
    assert "StateRestored" in event_reasons(ctx, job_id)
    with ctx.session_factory() as s:
        assert s.scalar(select(func.max(StepMetric.step))) == 2
    assert run_reconcile_job(ctx, job_id) == "ok"  # twice equals once
    run_to(ctx, job_id, 5)
    assert np.array_equal(decode_state(ctx.blobs.get(state_key(ctx, job_id, 5))).params, before.params)


def test_hot_state_lost_at_a_checkpointed_step_is_restored_in_place_and_recorded(ctx) -> None:
    """Lost right at a step that has its checkpoint: nothing to rewind, but the loss and the
    restore are still an event (an operator must see that Redis lost the job's state)."""
    job_id = start_job(ctx)  # its step 0 state is written, not restored: no event
    assert "StateRestored" not in event_reasons(ctx, job_id)
    run_to(ctx, job_id, 3)  # checkpoint_every 3: the checkpoint is of the current step
    before = decode_state(ctx.blobs.get(state_key(ctx, job_id, 3)))
    ctx.blobs.flush()
    assert run_reconcile_job(ctx, job_id) == "ok"
    assert job(ctx, job_id).step == 3
    restored = [e for e in events(ctx, job_id) if e.reason == "StateRestored"]
    assert len(restored) == 1 and restored[0].data == {"lost_step": 3, "resumed_step": 3}
    assert np.array_equal(decode_state(ctx.blobs.get(state_key(ctx, job_id, 3))).params, before.params)


def events(ctx, job_id: str) -> list:
    from domain.store.models import Event

    with ctx.session_factory() as s:
        rows = s.scalars(select(Event).where(Event.job_id == job_id).order_by(Event.id)).all()
        s.expunge_all()
        return list(rows)


def test_lost_hot_state_without_a_checkpoint_restarts_from_the_seeded_init(ctx) -> None:
    job_id = start_job(ctx, tiny_spec(checkpoint_every=1000))
    run_to(ctx, job_id, 2)
    ctx.blobs.flush()
    run_reconcile_job(ctx, job_id)
    assert job(ctx, job_id).step == 0
    info = job_info(job_id, job(ctx, job_id).spec, ctx.settings.data_dir)
    assert np.array_equal(stored_state(ctx, job_id, 0).params, initial_state(info.model, info.spec).params)


def test_a_reconcile_that_read_the_job_just_before_a_commit_restores_nothing(
        ctx, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pass reads the job at step 1; step 1 commits and its state is dropped before the pass
    looks for it. Nothing was lost: no checkpoint read, no model built, no state written (a
    restore thrown away by the guarded update took a worker's CPU from the running step)."""
    job_id = start_job(ctx)
    run_to(ctx, job_id, 1)
    real_state_stored = reconcile.state_stored

    def commit_meanwhile(*args, **kwargs) -> bool:
        monkeypatch.setattr(reconcile, "state_stored", real_state_stored)
        upload_all(ctx, job_id, 1)
        assert run_apply_step(ctx, job_id, 1) == "applied"
        return real_state_stored(*args, **kwargs)

    monkeypatch.setattr(reconcile, "state_stored", commit_meanwhile)
    monkeypatch.setattr(recovery, "restore_point",
                        lambda *args: pytest.fail("a state nobody lost was restored"))
    monkeypatch.setattr(recovery, "store_state",
                        lambda *args: pytest.fail("a state was written for a moved job"))
    assert run_reconcile_job(ctx, job_id) == "moved-on"
    assert job(ctx, job_id).step == 2
    assert "StateRestored" not in event_reasons(ctx, job_id)
    monkeypatch.undo()
    assert run_reconcile_job(ctx, job_id) == "ok"  # the next pass sees the job as it is
    run_to(ctx, job_id, 3)


def test_a_complete_step_is_left_one_pass_to_the_replica_that_completed_it(ctx) -> None:
    """The replica that stores a step's last upload claims it at once and applies it from its
    own memory. A reconcile pass that sees the step complete and unclaimed first sends it to
    the workers only if a later pass still finds it unclaimed (that replica died)."""
    job_id = start_job(ctx)
    upload_all(ctx, job_id, 0)  # stored, and nobody claimed it
    assert run_reconcile_job(ctx, job_id) == "apply-due"
    assert not ctx.blobs.exists(keys.apply_claim(job_id, 0))  # the replica's to claim
    assert run_reconcile_job(ctx, job_id) == "apply-enqueued"
    assert ctx.blobs.exists(keys.apply_claim(job_id, 0))
    assert run_apply_step(ctx, job_id, 0) == "applied"  # as a worker would
    assert not ctx.blobs.exists(keys.apply_due(job_id, 0))  # dropped with the step's keys
    assert job(ctx, job_id).step == 1

    upload_all(ctx, job_id, 1)
    ctx.blobs.set(keys.apply_claim(job_id, 1), b"1")  # the replica's claim, then its apply fails
    assert run_reconcile_job(ctx, job_id) == "apply-due"
    ctx.blobs.delete(keys.apply_claim(job_id, 1))  # the claim expires
    assert run_reconcile_job(ctx, job_id) == "apply-enqueued"  # the first pass after it
    assert ctx.blobs.exists(keys.apply_claim(job_id, 1))
    assert run_apply_step(ctx, job_id, 1) == "applied"

    upload_all(ctx, job_id, 2)  # results no upload counted (stored by an older replica):
    ctx.blobs.delete(keys.covered(job_id, 2))  # no upload saw the step complete, none claims
    assert run_reconcile_job(ctx, job_id) == "apply-enqueued"  # sent at the first pass
    assert ctx.blobs.exists(keys.apply_claim(job_id, 2))


def test_cancel_releases_assignments_twice_equals_once(ctx) -> None:
    job_id = start_job(ctx)
    with transaction(ctx.session_factory) as s:
        s.get(Job, job_id).state = "Cancelled"
    assert run_reconcile_job(ctx, job_id) == "released:4"
    assert run_reconcile_job(ctx, job_id) == "released:0"
    assert assignments(ctx, job_id) == [] and ctx.blobs.keys(keys.job_prefix(job_id)) == []


def test_a_notready_device_loses_its_shards_at_once(ctx) -> None:
    job_id = start_job(ctx, devices=3)
    set_device(ctx, "dev-01", state="NotReady")
    run_reconcile(ctx)
    held = {d for _, d, _ in assignments(ctx, job_id)}
    assert "dev-01" not in held and len(assignments(ctx, job_id)) == 4
    assert "ShardsMoved" in event_reasons(ctx, job_id)
    run_reconcile(ctx)
    assert event_reasons(ctx, job_id).count("ShardsMoved") == 1


def test_below_min_devices_the_job_waits_at_its_step(ctx) -> None:
    job_id = start_job(ctx, tiny_spec(placement={"min_devices": 2}), devices=2)
    run_to(ctx, job_id, 2)
    set_device(ctx, "dev-00", pause_reason="thermal")
    run_reconcile(ctx)
    waiting = job(ctx, job_id)
    assert waiting.state == "Pending" and waiting.step == 2
    assert "min_devices 2" in waiting.reason
    set_device(ctx, "dev-00", pause_reason=None)
    run_reconcile(ctx)
    assert job(ctx, job_id).state == "Running" and job(ctx, job_id).step == 2


def test_a_higher_priority_gang_preempts_at_its_step(ctx) -> None:
    low = start_job(ctx, tiny_spec(placement={"min_devices": 2}), devices=2)
    run_to(ctx, low, 1)
    high = submit(ctx, tiny_spec(name="high", priority=10, placement={"min_devices": 2}))
    run_reconcile(ctx)
    assert job(ctx, high).state == "Running"
    preempted = job(ctx, low)
    assert preempted.state == "Pending" and preempted.step == 1 and "preempted" in preempted.reason


def test_a_users_jobs_wait_at_their_limits_and_never_preempt_but_admins_jobs_are_free(ctx) -> None:
    ctx.settings = ctx.settings.model_copy(update={"user_max_running_jobs": 1,
                                                   "user_max_devices": 3})
    add_devices(ctx, 12)
    alices = [submit(ctx, tiny_spec(name=f"a{i}", priority=i), owner="alice") for i in range(2)]
    bobs = submit(ctx, tiny_spec(name="b"), owner="bob")
    admins = submit(ctx, tiny_spec(name="admin"))
    run_reconcile(ctx)
    first, second = job(ctx, alices[1]), job(ctx, alices[0])  # the higher priority goes first
    assert first.state == "Running" and len(devices_of(ctx, first.id)) == 3  # not 4: her limit
    assert second.state == "Pending" and "PHALANX_USER_MAX_RUNNING_JOBS" in second.reason
    assert "alice runs 1 job(s)" in second.reason
    assert job(ctx, bobs).state == "Running" and len(devices_of(ctx, bobs)) == 3  # his own limit
    assert job(ctx, admins).state == "Running" and len(devices_of(ctx, admins)) == 4
    # a second running job is allowed now, but her devices are all in use
    ctx.settings = ctx.settings.model_copy(update={"user_max_running_jobs": 2})
    run_reconcile(ctx)
    waiting = job(ctx, alices[0])
    assert waiting.state == "Pending" and "PHALANX_USER_MAX_DEVICES" in waiting.reason
    assert "hold 3 device(s)" in waiting.reason
    assert job(ctx, first.id).state == "Running"  # never preempted by its owner's own job


def devices_of(ctx, job_id: str) -> set[str]:
    return {device for _, device, _ in assignments(ctx, job_id)}


def test_a_preempted_jobs_accepted_results_count_when_it_resumes(ctx) -> None:
    low = start_job(ctx, tiny_spec(placement={"min_devices": 2}), devices=2)
    run_to(ctx, low, 1)
    early = shard_result_blobs(ctx, low, 1)
    upload_all(ctx, low, 1, shards=(0, 1), blobs=early)  # accepted before the preemption
    high = submit(ctx, tiny_spec(name="high", priority=10, placement={"min_devices": 2}))
    run_reconcile(ctx)
    assert job(ctx, low).state == "Pending" and job(ctx, high).state == "Running"
    with transaction(ctx.session_factory) as s:
        s.get(Job, high).state = "Cancelled"
    assert run_reconcile_job(ctx, high) == "released:4"  # its devices are free again
    run_reconcile(ctx)
    run_reconcile_job(ctx, low)
    assert job(ctx, low).state == "Running" and job(ctx, low).step == 1
    upload_all(ctx, low, 1, shards=(2, 3), blobs=early)  # only the rest, after the resume
    assert run_apply_step(ctx, low, 1) == "applied"
    assert job(ctx, low).step == 2


def test_a_late_device_gets_backups_once(ctx) -> None:
    clock: Clock = ctx.clock
    job_id = start_job(ctx, devices=2)
    shards_of_00 = [s for s, d, _ in assignments(ctx, job_id) if d == "dev-00"]
    blobs = shard_result_blobs(ctx, job_id, 0)
    upload_all(ctx, job_id, 0, shards=[k for k in range(4) if k not in shards_of_00], blobs=blobs)
    ctx.blobs.set(keys.latency(job_id, "dev-01"), b"0.1")
    clock.advance(1.0)
    assert run_reconcile_job(ctx, job_id) == "ok"  # floor 2 s not reached yet
    clock.advance(5.0)
    assert run_reconcile_job(ctx, job_id) == f"backups:{len(shards_of_00)}"
    assert run_reconcile_job(ctx, job_id) == "ok"
    backups = [(s, d) for s, d, role in assignments(ctx, job_id) if role == "backup"]
    assert backups == [(s, "dev-01") for s in shards_of_00]
    upload_all(ctx, job_id, 0, shards=shards_of_00, blobs=blobs)  # the backups' results
    assert run_apply_step(ctx, job_id, 0) == "applied"
    # the backups are dropped at the step boundary; each shard keeps its one primary
    after = assignments(ctx, job_id)
    assert [role for _, _, role in after] == ["primary"] * 4
    assert sorted(s for s, _, _ in after) == [0, 1, 2, 3]


def test_a_new_device_joins_at_the_next_step_boundary(ctx) -> None:
    job_id = start_job(ctx, tiny_spec(placement={"max_devices": 4}), devices=2)
    add_devices(ctx, 2, prefix="new")
    run_reconcile(ctx)
    assert {d for _, d, _ in assignments(ctx, job_id)} == {"dev-00", "dev-01"}
    run_to(ctx, job_id, 1)
    assert {d for _, d, _ in assignments(ctx, job_id)} == {"dev-00", "dev-01", "new-00", "new-01"}
    assert "DeviceJoined" in event_reasons(ctx, job_id)


def test_lease_loss_of_most_of_the_fleet_evicts_slowly(ctx) -> None:
    add_devices(ctx, 10)
    ids = [submit(ctx, tiny_spec(name=f"j{i}", shards=1, global_batch_size=4,
                                 placement={"max_devices": 1})) for i in range(10)]
    run_reconcile(ctx)
    assert all(job(ctx, i).state == "Running" for i in ids)
    for i in range(7):
        set_device(ctx, f"dev-{i:02d}", state="NotReady")
    run_reconcile(ctx)
    run_reconcile(ctx)
    waiting = [i for i in ids if job(ctx, i).state == "Pending"]
    assert len(waiting) == 1  # one eviction per window while 70% of the fleet looks down


def test_evictions_a_device_or_an_admin_asked_for_are_never_rate_limited(ctx) -> None:
    add_devices(ctx, 10)
    ids = [submit(ctx, tiny_spec(name=f"j{i}", shards=1, global_batch_size=4,
                                 placement={"max_devices": 1})) for i in range(10)]
    run_reconcile(ctx)
    holder = {i: assignments(ctx, i)[0][1] for i in ids}
    for n in range(7):
        set_device(ctx, f"dev-{n:02d}", state="NotReady")
    run_reconcile(ctx)
    run_reconcile(ctx)  # the disrupted fleet's budget (one lease-loss eviction) is used up
    lease_evicted = [i for i in ids if not assignments(ctx, i)]
    assert len(lease_evicted) == 1
    set_device(ctx, "dev-07", state="Draining", cordoned=True, draining=True)  # an admin's drain
    set_device(ctx, "dev-08", pause_reason="thermal")  # the phone asked to stop
    run_reconcile(ctx)
    for i in ids:
        if holder[i] in ("dev-07", "dev-08"):
            assert holder[i] not in {d for _, d, _ in assignments(ctx, i)}, holder[i]
    still_lost = [i for i in ids if holder[i] < "dev-07" and assignments(ctx, i)]
    assert len(still_lost) == 6  # lease loss still waits its turn


def test_a_job_the_engine_cannot_run_fails_with_a_reason_and_blocks_nobody(ctx) -> None:
    add_devices(ctx, 2)
    with transaction(ctx.session_factory) as s:
        broken = Job(name="gone", spec=tiny_spec(dataset="deleted-upload"), state="Pending")
        s.add(broken)
        s.flush()
        broken_id = broken.id
    fine = submit(ctx, tiny_spec(name="fine"))
    run_reconcile(ctx)
    failed = job(ctx, broken_id)
    assert failed.state == "Failed" and "deleted-upload" in failed.reason
    assert job(ctx, fine).state == "Running"
    assert run_reconcile_job(ctx, broken_id) == "released:0"


def test_a_job_whose_model_cannot_be_allocated_or_placed_fails_alone(ctx) -> None:
    """Specs that passed no API (rows written before a limit existed, or by hand): 10^9
    classes (63 GB of parameters) and a placement that is not a number. Each fails with its
    reason; the pass places the good job all the same, this time and the next."""
    add_devices(ctx, 2)
    huge_spec = tiny_spec(name="huge", dataset="synthetic:1x4x4:1000000000:64")
    odd_spec = tiny_spec(name="odd", placement={"min_devices": "many"})
    with transaction(ctx.session_factory) as s:
        bad = [Job(name=spec["name"], spec=spec, state="Pending") for spec in (huge_spec, odd_spec)]
        s.add_all(bad)
        s.flush()
        huge, odd = (j.id for j in bad)
    fine = submit(ctx, tiny_spec(name="fine"))
    run_reconcile(ctx)
    assert job(ctx, huge).state == "Failed" and "the limit is 200,000,000" in job(ctx, huge).reason
    assert job(ctx, odd).state == "Failed" and "could not place it" in job(ctx, odd).reason
    assert "Failed" in event_reasons(ctx, odd)
    assert job(ctx, fine).state == "Running"
    run_reconcile(ctx)  # and the next pass goes on too
    assert job(ctx, fine).state == "Running"


def test_a_persistent_straggler_gets_fewer_shards_at_the_boundary(ctx) -> None:
    from scheduler.tasks.stragglers import remember_late

    job_id = start_job(ctx, devices=2)
    before = [s for s, d, _ in assignments(ctx, job_id) if d == "dev-00"]
    remember_late(ctx, job_id, "dev-00", 0)
    run_to(ctx, job_id, 1)
    assert [s for s, d, _ in assignments(ctx, job_id) if d == "dev-00"] == before  # once is luck
    remember_late(ctx, job_id, "dev-00", 1)
    run_to(ctx, job_id, 2)
    after = [s for s, d, _ in assignments(ctx, job_id) if d == "dev-00"]
    assert 1 <= len(after) < len(before)
    assert "ShardsMoved" in event_reasons(ctx, job_id)


def test_reconcile_prunes_telemetry_past_retention_at_most_once_a_minute(ctx) -> None:
    (device,) = add_devices(ctx, 1)
    now = ctx.clock()
    keep = dt.timedelta(seconds=ctx.settings.telemetry_retention_s)

    def add(age: dt.timedelta) -> None:
        with transaction(ctx.session_factory) as s:
            s.add(TelemetrySample(device_id=device, ts=now - age, battery_pct=50.0))

    def ages() -> list[dt.datetime]:
        with ctx.session_factory() as s:
            return sorted(s.scalars(select(TelemetrySample.ts)))

    add(keep + dt.timedelta(hours=1))
    add(keep - dt.timedelta(hours=1))
    assert run_reconcile(ctx)["pruned"] == 1
    assert len(ages()) == 1 and ages()[0].replace(tzinfo=None) > (now - keep).replace(tzinfo=None)
    add(keep + dt.timedelta(hours=2))
    assert run_reconcile(ctx)["pruned"] == 0  # within the minute: the next window prunes it
    ctx.blobs.delete(keys.TELEMETRY_PRUNED)
    assert run_reconcile(ctx)["pruned"] == 1
    assert len(ages()) == 1


def test_reconcile_keeps_the_newest_events_and_step_metrics_of_each_job(ctx) -> None:
    ctx.settings = ctx.settings.model_copy(update={"events_kept_per_job": 3,
                                                   "step_metrics_kept_per_job": 2})
    (device,) = add_devices(ctx, 1)
    waits = {"min_devices": 2}  # never placed: no events of its own meanwhile
    busy = submit(ctx, tiny_spec(name="busy", placement=waits))
    quiet = submit(ctx, tiny_spec(name="quiet", placement=waits))
    now = ctx.clock()
    old = now - dt.timedelta(seconds=ctx.settings.device_event_retention_s + 60)
    with transaction(ctx.session_factory) as s:
        for i in range(5):
            s.add(Event(job_id=busy, ts=now, reason=f"R{i}", message=""))
            s.add(StepMetric(job_id=busy, step=i, ts=now, train_loss=1.0 / (i + 1)))
        s.add(Event(job_id=quiet, ts=old, reason="Old", message=""))  # a job's: kept by count
        s.add(Event(device_id=device, ts=old, reason="NodeNotReady", message=""))
        s.add(Event(device_id=device, ts=now, reason="NodeReady", message=""))
    assert run_reconcile(ctx)["pruned_history"] == {"events": 3, "step_metrics": 3}
    with ctx.session_factory() as s:
        kept = s.scalars(select(Event.reason).where(Event.job_id == busy).order_by(Event.id))
        assert list(kept) == ["R2", "R3", "R4"]
        steps = s.scalars(select(StepMetric.step).where(StepMetric.job_id == busy)
                          .order_by(StepMetric.step))
        assert list(steps) == [3, 4]
        assert list(s.scalars(select(Event.reason).where(Event.job_id == quiet))) == ["Old"]
        device_events = s.scalars(select(Event.reason).where(Event.device_id == device,
                                                             Event.job_id.is_(None)))
        assert list(device_events) == ["NodeReady"]


def test_the_next_step_reads_the_state_this_process_wrote_but_only_while_it_is_stored(ctx) -> None:
    """apply_step keeps the state it wrote; the next apply_step uses it instead of reading (and
    decoding) the blob again, and falls back to the blob store's answer once the key is gone."""
    job_id = start_job(ctx)
    upload_all(ctx, job_id, 0)
    assert run_apply_step(ctx, job_id, 0) == "applied"
    nonce = job(ctx, job_id).state_nonce
    kept = RECENT.get(job_id, 1, nonce)
    assert kept is not None and kept.step == 1
    assert RECENT.get(job_id, 1, "another") is None  # the step reached again is another state
    assert stored_state(ctx, job_id, 1) is kept  # the very object: no read, no decode
    assert np.array_equal(decode_state(ctx.blobs.get(state_key(ctx, job_id, 1))).params, kept.params)
    assert RECENT.get(job_id, 0, nonce) is None  # only the step it is for
    ctx.blobs.delete(state_key(ctx, job_id, 1))  # what a Redis restart does to it
    assert stored_state(ctx, job_id, 1) is None  # the restore path runs, as without the cache


def test_a_result_whose_upload_body_was_lost_is_recomputed_not_applied(ctx) -> None:
    """Shard keys point into the stored upload; if that body is gone (evicted, lost with a
    Redis restart), apply_step must not apply a partial step: it drops the orphaned shard
    keys so their devices upload again, and applies once they have."""
    job_id = start_job(ctx)
    upload_all(ctx, job_id, 0)
    bodies = ctx.blobs.keys(f"job:{job_id}:body:0:")
    assert bodies
    ctx.blobs.delete(bodies[0])
    assert run_apply_step(ctx, job_id, 0) == "incomplete"
    assert job(ctx, job_id).step == 0
    assert len(ctx.blobs.keys(keys.grad_prefix(job_id, 0))) < job(ctx, job_id).spec["shards"]
    upload_all(ctx, job_id, 0)  # the devices upload the missing shards again
    assert run_apply_step(ctx, job_id, 0) == "applied"


def _disk_full_for(ctx, job_id: str, step: int) -> Path:
    """The checkpoint of `step` will be written into /dev/full: the kernel answers its write
    with ENOSPC, exactly as a full disk does (the temp file's random part is fixed to "full"
    by the test, so the temp file can be named here)."""
    from scheduler.checkpoints import checkpoint_path

    path = checkpoint_path(ctx.settings.artifacts_dir, job_id, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp-full")
    tmp.symlink_to("/dev/full")
    return tmp


def test_a_full_disk_skips_a_checkpoint_with_a_warning_and_waits_for_the_final_one(
        ctx, monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from domain.store.models import Checkpoint, Event
    from scheduler import checkpoints
    from scheduler.checkpoints import checkpoint_path, read_checkpoint

    monkeypatch.setattr(checkpoints, "uuid", SimpleNamespace(uuid4=lambda: SimpleNamespace(hex="full")))

    job_id = start_job(ctx, tiny_spec(checkpoint_every=2))
    info = job_info(job_id, job(ctx, job_id).spec, ctx.settings.data_dir)
    total = info.total_steps
    run_to(ctx, job_id, 1)
    full = _disk_full_for(ctx, job_id, 2)
    upload_all(ctx, job_id, 1)
    assert run_apply_step(ctx, job_id, 1) == "applied"  # the job goes on without it
    assert job(ctx, job_id).step == 2
    assert not full.exists() and not checkpoint_path(ctx.settings.artifacts_dir, job_id, 2).exists()
    with ctx.session_factory() as s:
        assert not s.query(Checkpoint).filter_by(job_id=job_id, step=2).all()  # never served
        warned = [e for e in s.query(Event).filter_by(job_id=job_id, reason="CheckpointFailed")]
    assert len(warned) == 1 and "No space left on device" in warned[0].message
    assert warned[0].kind == "Warning" and warned[0].data == {"step": 2, "final": False}

    run_to(ctx, job_id, total - 1)
    _disk_full_for(ctx, job_id, total)
    upload_all(ctx, job_id, total - 1)
    assert run_apply_step(ctx, job_id, total - 1) == "retry"  # the result is not lost: it waits
    assert job(ctx, job_id).state == "Running" and job(ctx, job_id).step == total - 1
    assert "CheckpointFailed" in event_reasons(ctx, job_id)[-1:]
    # space is back (the failed write left nothing behind): the retry finishes the job
    assert run_apply_step(ctx, job_id, total - 1) == "applied"
    assert job(ctx, job_id).state == "Succeeded"
    with ctx.session_factory() as s:
        final = s.query(Checkpoint).filter_by(job_id=job_id, step=total).one()
        assert read_checkpoint(final, info.model) is not None
    leftovers = list(checkpoint_path(ctx.settings.artifacts_dir, job_id, 0).parent.glob("*.tmp-*"))
    assert not leftovers


def test_only_the_newest_checkpoints_are_kept_and_a_restore_still_finds_one(ctx) -> None:
    from domain.store.models import Checkpoint
    from scheduler.checkpoints import checkpoint_path

    ctx.settings = ctx.settings.model_copy(update={"checkpoints_kept": 2})
    job_id = start_job(ctx, tiny_spec(checkpoint_every=1))
    run_to(ctx, job_id, 4)
    with ctx.session_factory() as s:
        rows = sorted(r.step for r in s.query(Checkpoint).filter_by(job_id=job_id))
    assert rows == [3, 4]
    on_disk = {k for k in range(1, 5)
               if checkpoint_path(ctx.settings.artifacts_dir, job_id, k).exists()}
    assert on_disk == {3, 4}  # the files of deleted rows are gone too
    ctx.blobs.delete(state_key(ctx, job_id, 4))  # Redis lost the hot state: restore from disk
    assert stored_state(ctx, job_id, 4) is None
    assert run_reconcile_job(ctx, job_id) == "ok"
    assert job(ctx, job_id).step == 4 and stored_state(ctx, job_id, 4) is not None
