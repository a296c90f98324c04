"""A `class` job's compute class, against a real database: chosen at the first placement and
kept in the job's row; joins, moves and a holder whose class changes all keep the job's shards
on it. A portable job uses every class whose agent computes the portable path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agent.runtime.agent import FEATURES, compute_class
from domain.store.db import transaction
from domain.store.models import Job, ShardAssignment
from scheduler.tasks.reconcile import run_reconcile, run_reconcile_job
from tests.scheduler.helpers import (
    add_devices,
    assignments,
    event_reasons,
    job,
    make_ctx,
    run_to,
    set_device,
    submit,
    tiny_spec,
)

A, B = "a1" * 8, "b2" * 8  # two compute classes' fingerprints


def caps(fingerprint: str | None, features: tuple[str, ...] = FEATURES) -> dict[str, Any]:
    """An agent of today on a machine of class `fingerprint` (None: an older agent that does
    not report its class)."""
    out: dict[str, Any] = {"features": list(features)}
    if fingerprint is not None:
        out["compute_class"] = {**compute_class(), "fingerprint": fingerprint}
    return out


@pytest.fixture
def ctx(db_url: str, tmp_path: Path):
    return make_ctx(db_url, tmp_path)


def holders(ctx, job_id: str) -> set[str]:
    return {d for _, d, _ in assignments(ctx, job_id)}


def test_a_class_job_keeps_its_shards_on_the_class_its_first_placement_chose(ctx) -> None:
    add_devices(ctx, 2, prefix="a", capabilities=caps(A))
    add_devices(ctx, 3, prefix="b", capabilities=caps(B))  # as fast each: class B is faster
    job_id = submit(ctx, tiny_spec(exactness="class"))
    run_reconcile(ctx)
    assert run_reconcile_job(ctx, job_id) == "ok"
    row = job(ctx, job_id)
    assert row.state == "Running" and row.compute_class == B
    assert holders(ctx, job_id) == {"b-00", "b-01", "b-02"}
    # a free phone of the other class and one whose agent reports no class never join
    add_devices(ctx, 1, prefix="late-a", capabilities=caps(A))
    add_devices(ctx, 1, prefix="late-old", capabilities=caps(None))
    run_reconcile(ctx)
    run_to(ctx, job_id, 1)
    assert holders(ctx, job_id) == {"b-00", "b-01", "b-02"}
    assert "DeviceJoined" not in event_reasons(ctx, job_id)
    # one of its own class does, at the next boundary
    add_devices(ctx, 1, prefix="late-b", capabilities=caps(B))
    run_reconcile(ctx)
    run_to(ctx, job_id, 2)
    assert holders(ctx, job_id) == {"b-00", "b-01", "b-02", "late-b-00"}
    # a holder that now reports another class (its numpy changed) gives its shards up to its
    # own class's phones, never to the free phones of class A
    set_device(ctx, "b-00", capabilities=caps(A))
    run_reconcile(ctx)
    assert holders(ctx, job_id) == {"b-01", "b-02", "late-b-00"}
    assert job(ctx, job_id).compute_class == B


def test_a_class_job_waits_for_its_class_and_resumes_on_it(ctx) -> None:
    add_devices(ctx, 2, prefix="b", capabilities=caps(B))
    job_id = submit(ctx, tiny_spec(exactness="class", placement={"min_devices": 2}))
    run_reconcile(ctx)
    assert job(ctx, job_id).compute_class == B
    # both its phones go: phones of class A cannot take it over, whatever their number
    add_devices(ctx, 4, prefix="a", capabilities=caps(A))
    set_device(ctx, "b-00", cordoned=True)
    run_reconcile(ctx)
    waiting = job(ctx, job_id)
    assert waiting.state == "Pending" and holders(ctx, job_id) == set()
    assert "another compute class" in (waiting.reason or "")
    add_devices(ctx, 1, prefix="b2", capabilities=caps(B))
    run_reconcile(ctx)
    assert job(ctx, job_id).state == "Running"
    assert holders(ctx, job_id) == {"b-01", "b2-00"}


def test_a_portable_job_uses_every_class_but_never_an_agent_without_the_portable_path(
        ctx) -> None:
    add_devices(ctx, 2, prefix="a", capabilities=caps(A))
    add_devices(ctx, 2, prefix="b", capabilities=caps(B))
    add_devices(ctx, 1, prefix="noclass", capabilities=caps(None))
    add_devices(ctx, 1, prefix="older", capabilities=caps(A, features=("augment",)))
    job_id = submit(ctx, tiny_spec(exactness="portable", shards=8, global_batch_size=16,
                                   placement={"max_devices": 8}))
    run_reconcile(ctx)
    row = job(ctx, job_id)
    assert row.state == "Running" and row.compute_class is None
    assert holders(ctx, job_id) == {"a-00", "a-01", "b-00", "b-01", "noclass-00"}


def test_a_running_class_job_placed_before_it_had_a_class_settles_on_its_holders_best(
        ctx) -> None:
    add_devices(ctx, 2, prefix="a", capabilities=caps(A))
    add_devices(ctx, 1, prefix="b", capabilities=caps(B))
    add_devices(ctx, 1, prefix="old", capabilities=caps(None))
    job_id = submit(ctx, tiny_spec(exactness="class"))
    with transaction(ctx.session_factory) as s:  # as placed before jobs kept their class
        s.add_all(ShardAssignment(job_id=job_id, shard=k, device_id=d) for k, d in
                  enumerate(["a-00", "a-01", "b-00", "old-00"]))
        s.get(Job, job_id).state = "Running"
    run_reconcile(ctx)
    assert job(ctx, job_id).compute_class == A
    assert holders(ctx, job_id) == {"a-00", "a-01"}
    assert "ComputeClassChosen" in event_reasons(ctx, job_id)
