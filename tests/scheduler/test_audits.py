"""Audits through the scheduler and the store (scheduler/audits.py): a step waits for its
audits and commits when they agree; a third device decides a mismatch; the loser is
quarantined, its results of the step deleted and recomputed by others; a job whose state holds
unaudited results of a liar rewinds to a checkpoint before them; and every job still ends on
the honest run's weights, bit for bit. Phones are played by hand: results computed by the
engine, uploaded the way the step protocol stores them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from api.steps.protocol import store_audit_results, store_results
from domain.settings import Settings
from domain.store.audits import verified_steps
from domain.store.db import transaction
from domain.store.lifecycle import uncordon
from domain.store.models import AuditRecord, Device, Event, ShardAssignment
from engine import tree
from engine.step import ShardResult, reduce_results
from hotstate import keys
from roots.api import create_app
from scheduler import context
from scheduler.context import SchedulerContext
from scheduler.tasks.reconcile import run_reconcile, run_reconcile_job
from scheduler.tasks.steps import run_apply_step
from tests.scheduler.helpers import (
    add_devices,
    admin,
    enroll,
    job,
    make_ctx,
    shard_result_blobs,
    start_job,
    tiny_spec,
)
from tests.support.databases import migrated_sqlite
from tests.support.env import ADMIN_TOKEN as ADMIN
from wire.messages import decode_results, encode_results


def audited_spec(rate: float = 1.0, probation: int = 0, **over: Any) -> dict[str, Any]:
    return tiny_spec(verification={"audit_rate": rate, "probation_steps": probation}, **over)


def rows(ctx: SchedulerContext, job_id: str, *roles: str) -> list[tuple[int, int, str, str]]:
    """(lo, hi, role, device) of the job's assignments in `roles`."""
    with ctx.session_factory() as s:
        found = s.scalars(select(ShardAssignment).where(ShardAssignment.job_id == job_id,
                                                        ShardAssignment.role.in_(roles)))
        return sorted((a.shard, a.shard + a.span, a.role, a.device_id) for a in found)


def primaries(ctx: SchedulerContext, job_id: str) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for lo, _, _, device in rows(ctx, job_id, "primary"):
        out.setdefault(device, []).append(lo)
    return out


def node_result(leaves: dict[int, bytes], node: tuple[int, int]) -> ShardResult:
    """A node's result as a phone uploads it: its shards' results added up the tree."""
    results = [decode_results(leaves[k])[0] for k in range(*node)]
    return reduce_results(results, *node, "float32")


def lie(r: ShardResult) -> ShardResult:
    grad = r.grad_sum.copy()
    grad[0] += 1.0  # one float changed
    return replace(r, grad_sum=grad)


def upload(ctx: SchedulerContext, job_id: str, step: int, r: ShardResult, device: str,
           role: str | None = None) -> None:
    body = bytearray(encode_results(job_id, step, [r]))
    got = decode_results(body)
    if role is None:
        store_results(ctx.blobs, job_id, step, body, got, device)
    else:
        store_audit_results(ctx.blobs, job_id, step, body, [(got[0], role)], device)


def play(ctx: SchedulerContext, job_id: str, liar: str | None = None,
         lie_as: tuple[str, ...] = ("primary",)) -> str:
    """One step as honest phones (and `liar`, lying in the roles `lie_as`) play it: each
    holder uploads the nodes of its shards, each auditor and decider its node, until the apply
    says something other than incomplete or nothing is left to upload."""
    step = job(ctx, job_id).step
    leaves = shard_result_blobs(ctx, job_id, step)
    done: set[tuple[int, int, str, str]] = set()
    while True:
        todo = [(lo, hi, "primary", d) for d, shards in primaries(ctx, job_id).items()
                for lo, hi in tree.cover(shards, len(leaves))]
        todo += rows(ctx, job_id, "audit", "decide")
        fresh = [t for t in todo if t not in done]
        for lo, hi, role, device in fresh:
            r = node_result(leaves, (lo, hi))
            upload(ctx, job_id, step, lie(r) if device == liar and role in lie_as else r,
                   device, None if role == "primary" else role)
            done.add((lo, hi, role, device))
        outcome = run_apply_step(ctx, job_id, step)
        if outcome != "incomplete" or not fresh or job(ctx, job_id).step != step:
            return outcome  # applied, or nothing more to upload, or rewound


def run_honest(ctx: SchedulerContext, job_id: str) -> dict[str, Any]:
    while job(ctx, job_id).state == "Running":
        assert play(ctx, job_id) == "applied"
    return job(ctx, job_id).metrics


def events(ctx: SchedulerContext, job_id: str | None = None,
           device_id: str | None = None) -> list[Event]:
    with ctx.session_factory() as s:
        query = select(Event).order_by(Event.id)
        if job_id:
            query = query.where(Event.job_id == job_id)
        if device_id:
            query = query.where(Event.device_id == device_id)
        found = list(s.scalars(query))
        s.expunge_all()
        return found


@pytest.fixture
def ctx(sqlite_url: str, tmp_path: Path) -> SchedulerContext:
    return make_ctx(sqlite_url, tmp_path)


@pytest.fixture(scope="module")
def honest_sha(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The tiny job's final weights with no audits and no liar (the same math for any spec
    that differs only in its verification)."""
    where = tmp_path_factory.mktemp("honest")
    other = make_ctx(migrated_sqlite(where / "honest.sqlite"), where)
    job_id = start_job(other, tiny_spec(), devices=2)
    return str(run_honest(other, job_id)["params_sha256"])


def test_an_audited_step_waits_for_its_audit_and_commits_when_it_agrees(
        ctx: SchedulerContext) -> None:
    job_id = start_job(ctx, audited_spec(rate=1.0), devices=2)
    audits = rows(ctx, job_id, "audit")
    assert audits, "every node of step 0 is audited at rate 1"
    for lo, _hi, _, auditor in audits:  # never its own holder's
        assert all(auditor != d for d, s in primaries(ctx, job_id).items() if lo in s)
    leaves = shard_result_blobs(ctx, job_id, 0)
    for device, shards in primaries(ctx, job_id).items():
        for node in tree.cover(shards, 4):
            upload(ctx, job_id, 0, node_result(leaves, node), device)
    assert run_apply_step(ctx, job_id, 0) == "incomplete"  # the audits are not in
    assert not ctx.blobs.exists(keys.apply_claim(job_id, 0))  # the audit's upload applies it
    for lo, hi, _, auditor in audits:
        upload(ctx, job_id, 0, node_result(leaves, (lo, hi)), auditor, "audit")
    assert run_apply_step(ctx, job_id, 0) == "applied"
    with ctx.session_factory() as s:
        assert verified_steps(s, job_id) == dict.fromkeys(primaries(ctx, job_id), 1)
        assert all(r.first_unaudited_step is None for r in s.scalars(select(AuditRecord)))
    assert {a[3] for a in rows(ctx, job_id, "audit")}  # step 1's, assigned at the boundary


def test_probation_audits_a_devices_every_node_then_only_the_drawn(
        ctx: SchedulerContext) -> None:
    job_id = start_job(ctx, audited_spec(rate=0.0, probation=2), devices=2)
    for step in range(2):
        nodes = {(lo, hi) for d, s in primaries(ctx, job_id).items() for lo, hi in
                 tree.cover(s, 4)}
        assert {(lo, hi) for lo, hi, _, _ in rows(ctx, job_id, "audit")} == nodes, step
        assert play(ctx, job_id) == "applied"
    assert rows(ctx, job_id, "audit") == []  # probation served, rate 0: none drawn
    assert play(ctx, job_id) == "applied"
    with ctx.session_factory() as s:
        records = {r.device_id: r for r in s.scalars(select(AuditRecord))}
    assert {d: (r.verified_steps, r.first_unaudited_step) for d, r in records.items()} == \
        dict.fromkeys(primaries(ctx, job_id), (2, 2))


def test_a_liar_is_outvoted_quarantined_and_the_job_still_ends_on_the_honest_weights(
        ctx: SchedulerContext, honest_sha: str) -> None:
    job_id = start_job(ctx, audited_spec(rate=1.0), devices=3)
    assert play(ctx, job_id) == "applied"
    liar = sorted(primaries(ctx, job_id))[0]
    assert play(ctx, job_id, liar=liar) == "incomplete"  # quarantined: the step waits
    mismatch = [e for e in events(ctx, job_id) if e.reason == "ResultMismatch"]
    assert len(mismatch) == 1 and mismatch[0].device_id == liar
    facts = mismatch[0].data
    assert facts["step"] == 1 and facts["loser"] == liar and facts["rewind_to"] is None
    assert facts["holder_sha256"] != facts["auditor_sha256"] == facts["decider_sha256"]
    assert f"step 1, shards {facts['node'][0]}..{facts['node'][1] - 1}" in mismatch[0].message
    with ctx.session_factory() as s:
        device = s.get(Device, liar)
        assert device.cordoned and device.state == "Cordoned"
        assert "differs from the one two of three devices computed" in device.quarantine_reason
    assert liar not in {d for *_, d in rows(ctx, job_id, "primary", "audit", "decide")}
    by = [k for k in ctx.blobs.keys(f"job:{job_id}:by:1:")]
    assert liar.encode() not in ctx.blobs.get_many(by)  # its results of the step are gone
    run_reconcile(ctx)  # its shards move to the others
    assert sorted(primaries(ctx, job_id)) == sorted(set(primaries(ctx, job_id)) - {liar})
    assert len({k for s in primaries(ctx, job_id).values() for k in s}) == 4
    assert run_honest(ctx, job_id)["params_sha256"] == honest_sha
    reasons = [e.reason for e in events(ctx, device_id=liar)]
    assert "Quarantined" in reasons and "Cordoned" in reasons


def test_an_auditor_that_lies_is_the_one_quarantined(ctx: SchedulerContext,
                                                     honest_sha: str) -> None:
    job_id = start_job(ctx, audited_spec(rate=1.0), devices=3)
    liar = rows(ctx, job_id, "audit")[0][3]
    assert play(ctx, job_id, liar=liar, lie_as=("audit",)) == "incomplete"
    [mismatch] = [e for e in events(ctx, job_id) if e.reason == "ResultMismatch"]
    assert mismatch.data["loser"] == liar == mismatch.data["auditor"]
    assert mismatch.data["auditor_sha256"] != mismatch.data["holder_sha256"] == \
        mismatch.data["decider_sha256"]
    run_reconcile(ctx)
    assert run_honest(ctx, job_id)["params_sha256"] == honest_sha


@pytest.mark.parametrize("first_unaudited,resumed", [(3, 3), (2, 0)])
def test_a_liar_with_unaudited_results_in_the_state_rewinds_the_job_before_them(
        ctx: SchedulerContext, honest_sha: str, first_unaudited: int, resumed: int) -> None:
    """Its first unaudited result at step 3: the checkpoint of step 3 holds none of it (state
    3 is the results of steps 0..2); at step 2: no checkpoint that old, step 0's init."""
    job_id = start_job(ctx, audited_spec(rate=1.0), devices=3)
    for _ in range(4):
        assert play(ctx, job_id) == "applied"  # a checkpoint at step 3
    liar = sorted(primaries(ctx, job_id))[0]
    with transaction(ctx.session_factory) as s:  # as if a result of it went unaudited
        s.get(AuditRecord, (job_id, liar)).first_unaudited_step = first_unaudited
    assert play(ctx, job_id, liar=liar) == "incomplete"
    assert job(ctx, job_id).step == resumed
    rewound = [e for e in events(ctx, job_id) if e.reason == "RewoundForAudit"]
    assert rewound and rewound[0].data == {"device": liar, "lost_step": 4,
                                           "resumed_step": resumed,
                                           "first_unaudited": first_unaudited}
    run_reconcile(ctx)
    run_reconcile_job(ctx, job_id)
    assert run_honest(ctx, job_id)["params_sha256"] == honest_sha


def test_a_job_on_one_device_is_not_held_up_by_audits(ctx: SchedulerContext) -> None:
    job_id = start_job(ctx, audited_spec(rate=1.0, probation=5), devices=1)
    assert rows(ctx, job_id, "audit") == []  # nobody to compare with
    assert play(ctx, job_id) == "applied"
    with ctx.session_factory() as s:
        [record] = s.scalars(select(AuditRecord)).all()
    assert (record.verified_steps, record.first_unaudited_step) == (0, 0)


def test_an_admins_uncordon_lifts_a_quarantine_and_says_who(ctx: SchedulerContext) -> None:
    add_devices(ctx, 1)
    from domain.store.lifecycle import quarantine

    with transaction(ctx.session_factory) as s:
        assert quarantine(s, "dev-00", "lied", ctx.clock())
        assert not quarantine(s, "dev-00", "lied again", ctx.clock())  # once
    with transaction(ctx.session_factory) as s:
        device, changed = uncordon(s, "dev-00", ctx.clock(), by="alice")
        assert changed and device.quarantine_reason is None and not device.cordoned
    lifted = [e for e in events(ctx, device_id="dev-00") if e.reason == "QuarantineLifted"]
    assert lifted[0].message == "quarantine lifted by alice (it was: lied)"


def test_an_auditor_gets_its_node_as_work_after_its_own_and_its_upload_is_kept_apart(
        sqlite_url: str, tmp_path: Path) -> None:
    settings = Settings(database_url=sqlite_url, data_dir=tmp_path / "data", admin_token=ADMIN)
    with TestClient(create_app(settings)) as client:
        phones = dict(enroll(client, f"phone-{i}") for i in range(2))
        r = client.post("/v1/jobs", headers=admin(client),
                        json=audited_spec(rate=1.0, placement={"min_devices": 2}))
        job_id = r.json()["id"]
        ctx = context.get_context()
        run_reconcile(ctx)
        run_reconcile_job(ctx, job_id)
        leaves = shard_result_blobs(ctx, job_id, 0)
        lo, hi, _, auditor = rows(ctx, job_id, "audit")[0]
        hdr = phones[auditor]
        own = sorted(primaries(ctx, job_id)[auditor])

        def work() -> list[int]:
            got = client.get(f"/v1/devices/{auditor}/work", params={"wait": 0}, headers=hdr)
            return (got.json()["assignment"] or {}).get("shards") or []

        assert work() == own  # its own shards first
        url = f"/v1/jobs/{job_id}/steps/0/gradients"
        mine = [node_result(leaves, n) for n in tree.cover(own, 4)]
        assert client.post(url, content=encode_results(job_id, 0, mine), headers=hdr).json() \
            == {"accepted": own, "duplicates": []}
        assert work() == list(range(lo, hi))  # then the node it audits
        data = client.get(f"/v1/jobs/{job_id}/shards/{lo}/data", headers=hdr)
        assert data.status_code == 200  # it may read the audited shards' data
        audit = node_result(leaves, (lo, hi))
        up = client.post(url, content=encode_results(job_id, 0, [audit]), headers=hdr)
        assert up.json() == {"accepted": list(range(lo, hi)), "duplicates": []}
        assert ctx.blobs.exists(keys.audit(job_id, 0, lo, hi - lo, "audit"))
        assert not ctx.blobs.exists(keys.grad(job_id, 0, lo, hi - lo))  # never the holder's
        assert ctx.blobs.get(keys.uploader(job_id, 0, lo, hi - lo, "audit")) == auditor.encode()
        assert work() == []
        other = client.post(url, content=encode_results(job_id, 0, [audit]), headers=hdr)
        assert other.json() == {"accepted": [], "duplicates": list(range(lo, hi))}
    context.reset()

