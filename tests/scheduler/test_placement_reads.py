"""What a placement pass reads (issue 45 item 1: a 2 s pass over 100,000 devices): the holders
of the running jobs, not the free fleet, unless a job is placed or one short of its wanted
devices looks for one more, and then in batches up to the first that fits. The decisions
are those of a pass over the whole fleet (tests/scheduler/test_placement*.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hotstate import keys
from scheduler import store_ops
from scheduler.tasks.reconcile import run_reconcile
from tests.scheduler.helpers import add_devices, job, make_ctx, start_job, submit, tiny_spec


@pytest.fixture
def read(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The ids of the devices each pass turned into placement views, in order."""
    seen: list[str] = []
    real = store_ops.device_view

    def counting(device: Any, job_id: str | None) -> Any:
        seen.append(device.id)
        return real(device, job_id)

    monkeypatch.setattr(store_ops, "device_view", counting)
    return seen


def test_a_steady_pass_reads_the_jobs_holders_not_the_free_fleet(
        db_url: str, tmp_path: Path, read: list[str]) -> None:
    ctx = make_ctx(db_url, tmp_path)
    job_id = start_job(ctx, tiny_spec(placement={"min_devices": 2, "max_devices": 2}), devices=2)
    add_devices(ctx, 300, prefix="free")
    read.clear()
    run_reconcile(ctx)
    assert sorted(read) == ["dev-00", "dev-01"]
    assert job(ctx, job_id).state == "Running"
    assert ctx.blobs.get(keys.rebalance(job_id)) is None  # it has what it wants


def test_a_job_short_of_devices_reads_free_devices_up_to_the_batch_that_fits(
        db_url: str, tmp_path: Path, read: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(store_ops, "IN_BATCH", 40)
    ctx = make_ctx(db_url, tmp_path)
    add_devices(ctx, 1, prefix="held", labels={"rack": "z"})
    job_id = submit(ctx, tiny_spec(placement={"min_devices": 1, "max_devices": 4,
                                              "selector": {"rack": "z"}}))
    run_reconcile(ctx)
    assert job(ctx, job_id).state == "Running"
    add_devices(ctx, 100, prefix="a", labels={"rack": "a"})  # by id first, and none fits
    add_devices(ctx, 5, prefix="y", labels={"rack": "z"})
    add_devices(ctx, 100, prefix="z", labels={"rack": "a"})
    read.clear()
    run_reconcile(ctx)
    assert ctx.blobs.get(keys.rebalance(job_id)) == b"1"  # a join at the next boundary
    # the holder, then the free devices by id in batches of 40 up to y-*'s: 3 batches of 206
    assert read[0] == "held-00" and len(read) == 1 + 120, len(read)


def test_a_pending_job_is_placed_from_the_whole_fleet(db_url: str, tmp_path: Path,
                                                      read: list[str]) -> None:
    ctx = make_ctx(db_url, tmp_path)
    add_devices(ctx, 30, prefix="free")
    job_id = submit(ctx, tiny_spec(placement={"min_devices": 3, "max_devices": 3}))
    read.clear()
    run_reconcile(ctx)
    assert job(ctx, job_id).state == "Running"
    assert len(set(read)) == 30
