"""Audits in the apply pipeline (DESIGN.md invariant 7: a phone's result is checked, not
trusted). scheduler.policy.audit decides; this module reads and writes.

- `assign_audits` (the step boundary, and reconcile for a job's first step): the step's audit
  rows, one per audited node, to other devices of the job (ShardAssignment role `audit`).
- `verify` (the apply pipeline's plan, before any range is applied): every applied result
  that needs an audit (drawn, or its uploader on probation) must have an audit of the same
  shards whose result is the same bytes; until then the step is INCOMPLETE (audits missing
  are assigned, late or departed auditors replaced). Two results that differ get a third
  device (role `decide`); the one two of three agree on wins, the loser is quarantined
  (`quarantine`): cordoned with a `ResultMismatch` event, its results of the step deleted,
  its shards taken from it, and the job rewound to the newest checkpoint holding no
  unaudited result of it.
- `record` (inside the step's commit): who was audited in full, who had a result applied
  unchecked (domain.store.audits).
"""

from __future__ import annotations

import hashlib
import logging
import statistics
import struct
from collections.abc import Mapping
from dataclasses import dataclass, replace

from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from domain.store import audits as records
from domain.store import events
from domain.store.db import transaction
from domain.store.lifecycle import quarantine as quarantine_device
from domain.store.models import Device, Job, ShardAssignment
from domain.store.states import Event as StateEvent
from domain.task_metrics import count
from engine import tree
from engine.jobinfo import JobInfo
from engine.spec import TrainSpec
from engine.step import ShardResult, reduce_results
from hotstate import keys
from hotstate.bodies import fetch_bodies
from hotstate.gradstore import GradBlobError, audit_nodes, body_key_of, unpack
from hotstate.version import bump_version
from scheduler import store_ops
from scheduler.celery_app import app
from scheduler.checkpoints import checkpoint_steps
from scheduler.context import SchedulerContext
from scheduler.policy.audit import (
    Node,
    Verdict,
    chosen_inside,
    judge,
    least_loaded,
    needs_audit,
    on_probation,
    plan_audits,
    rewind_target,
)
from scheduler.policy.straggler import expected_step_s, straggler_timeout
from scheduler.tasks.recovery import rewind
from wire.states import DeviceState

log = logging.getLogger(__name__)

AUDIT, DECIDE = "audit", "decide"
ROLES = (AUDIT, DECIDE)


@dataclass(frozen=True)
class Audited:
    """What the step's audits found, recorded with its commit: the devices whose every applied
    result was audited and agreed, and those with a result applied unchecked."""

    agreed: tuple[str, ...] = ()
    unaudited: tuple[str, ...] = ()


def audit_key(job: Job) -> str:
    """The draw's secret (jobs.audit_key); a job from before audits has its id."""
    return job.audit_key or job.id


# -- assignment -------------------------------------------------------------------------------

def assign_audits(ctx: SchedulerContext, session: Session, job: Job, spec: TrainSpec,
                  step: int) -> int:
    """The audit rows of `step` in place of any earlier ones (the step boundary, inside the
    commit, after its moves; reconcile for a step no boundary planned): every node a holder
    will upload (the cover of its primary shards) that is drawn or whose holder is on
    probation, each to the job's device with the least work per shard held (shards are
    proportional to speed). Returns how many; marks the step planned."""
    session.execute(delete(ShardAssignment).where(ShardAssignment.job_id == job.id,
                                                  ShardAssignment.role.in_(ROLES)))
    primaries = _primaries(session, job.id) if spec.audited else {}
    planned = 0
    if primaries:
        holders = set(primaries.values())
        probation = on_probation(records.verified_steps(session, job.id), holders,
                                 spec.probation_steps)
        plan = plan_audits(primaries, spec.shards, audit_key(job), step, spec.audit_rate,
                           probation, speeds=_speeds(session, holders, spec.arch))
        for (lo, hi), (_, auditor) in sorted(plan.items()):
            session.add(ShardAssignment(job_id=job.id, shard=lo, device_id=auditor, role=AUDIT,
                                        since_step=step, span=hi - lo))
        planned = len(plan)
    session.flush()
    ctx.blobs.set(keys.audits_planned(job.id, step), str(planned).encode())
    return planned


def ensure_audits(ctx: SchedulerContext, job: Job, info: JobInfo) -> bool:
    """Plan the audits of the job's current step when no step boundary did (its first step,
    a resume after Pending, a rewind): True when it planned them now."""
    if not info.spec.audited or ctx.blobs.exists(keys.audits_planned(job.id, job.step)):
        return False
    try:
        with transaction(ctx.session_factory) as session:
            row = session.get(Job, job.id)
            if row is None or row.step != job.step:
                return False
            assign_audits(ctx, session, row, info.spec, job.step)
    except IntegrityError:
        return False  # a step boundary planned them meanwhile
    bump_version(ctx.blobs)
    return True


def _speeds(session: Session, devices: set[str], arch: str) -> dict[str, float]:
    """Each device's measured samples/s for the job's model; one without a measurement counts
    as the median of those with one (1 when none has): an audit goes where the shards held
    leave the most room, which is where a step's audit delays it least."""
    rows = session.execute(select(Device.id, Device.profiles).where(
        Device.id.in_(sorted(devices))))
    measured = {d: store_ops.stored_speeds(p).get(arch) for d, p in rows}
    known = [v for v in measured.values() if v]
    default = statistics.median(known) if known else 1.0
    return {d: measured.get(d) or default for d in devices}


def _primaries(session: Session, job_id: str) -> dict[int, str]:
    rows = session.execute(select(ShardAssignment.shard, ShardAssignment.device_id).where(
        ShardAssignment.job_id == job_id, ShardAssignment.role == "primary"))
    return {int(shard): device for shard, device in rows}


# -- verification -----------------------------------------------------------------------------

@dataclass
class StepAudits:
    """One step's audits as the plan reads them."""

    job: Job
    info: JobInfo
    chosen: list[Node]  # the results the step adds
    by: dict[Node, str | None]  # who uploaded each
    rows: dict[tuple[Node, str], str]  # (node, role) -> the device computing it again
    holders: frozenset[str]  # the devices holding primaries now (who may audit)


def verify(ctx: SchedulerContext, job: Job, info: JobInfo, chosen: list[Node]) -> Audited | None:
    """The step's audits checked before it is planned: None while it must wait (an audit or a
    decision missing, a liar just quarantined), else what they found."""
    if not info.spec.audited:
        return Audited()
    names = [keys.uploader(job.id, job.step, lo, hi - lo) for lo, hi in chosen]
    by = {node: raw.decode() if raw else None
          for node, raw in zip(chosen, ctx.blobs.get_many(names))}
    with ctx.session_factory() as session:
        verified = records.verified_steps(session, job.id)
        rows, holders = _audit_rows(session, job.id, job.step)
    steps = StepAudits(job, info, chosen, by, rows, holders)
    probation = on_probation(verified, {d for d in by.values() if d}, info.spec.probation_steps)
    # a node nobody else in the job can compute again (a job of one device) is not audited
    required = {n for n in chosen if needs_audit(audit_key(job), job.step, n,
                                                 info.spec.audit_rate, by[n], probation)
                and holders - {by[n]}}
    agreed: set[Node] = set()
    waiting = False
    for (node, role), auditor in sorted(rows.items()):
        if role != AUDIT:
            continue
        inside = _comparable(steps, node, auditor)
        if inside is None:
            continue
        found = _compare(ctx, steps, node, inside, auditor)
        if found is None:
            return None  # a device was quarantined: its results go, the step waits
        if found:
            agreed.update(inside)
        elif any(n in required for n in inside):
            waiting = True
    missing = [n for n in sorted(required) if n not in agreed]
    if missing:
        _wait_for(ctx, steps, missing, waiting)
        return None
    return _audited(by, agreed)


def _audit_rows(session: Session, job_id: str, step: int
                ) -> tuple[dict[tuple[Node, str], str], frozenset[str]]:
    rows = session.execute(select(ShardAssignment.shard, ShardAssignment.span,
                                  ShardAssignment.role, ShardAssignment.device_id,
                                  ShardAssignment.since_step)
                           .where(ShardAssignment.job_id == job_id))
    audits, holders = {}, set()
    for shard, span, role, device, since in rows:
        if role in ROLES and since == step:
            audits[((int(shard), int(shard) + int(span or 1)), role)] = device
        elif role == "primary":
            holders.add(device)
    return audits, frozenset(holders)


def _comparable(steps: StepAudits, node: Node, auditor: str) -> list[Node] | None:
    """The applied results an audit of `node` checks: None when it checks none (a larger
    result was applied over it, or its auditor uploaded part of them itself)."""
    inside = chosen_inside(node, steps.chosen)
    if not inside or any(steps.by[n] in (None, auditor) for n in inside):
        return None
    return inside


def _audited(by: Mapping[Node, str | None], agreed: set[Node]) -> Audited:
    devices: dict[str, list[bool]] = {}
    for node, device in by.items():
        if device is not None:
            devices.setdefault(device, []).append(node in agreed)
    return Audited(tuple(sorted(d for d, ok in devices.items() if all(ok))),
                   tuple(sorted(d for d, ok in devices.items() if not all(ok))))


def _compare(ctx: SchedulerContext, steps: StepAudits, node: Node, inside: list[Node],
             auditor: str) -> bool | None:
    """Whether the audit of `node` agrees with the applied results inside it: True (the same
    bytes), False (not all in yet, or a decision pending), None (a loser was quarantined)."""
    job, info = steps.job, steps.info
    audit_side = _cover(audit_nodes(ctx.blobs, job.id, job.step, info.spec.shards, node, AUDIT),
                        node)
    if audit_side is None:
        return False
    names = [keys.grad(job.id, job.step, lo, hi - lo) for lo, hi in inside]
    agreed_key = keys.audit(job.id, job.step, node[0], node[1] - node[0], "agreed")
    stored = ctx.blobs.get_many([*names, *audit_side.values(), agreed_key])
    seen = hashlib.sha256(b"".join(bytes(d or b"-") for d in stored[:-1])).digest()
    if stored[-1] == seen:
        return True  # compared before, and nothing has changed since
    holder = _digest(ctx, info, node, inside, stored[:len(names)])
    audit = _digest(ctx, info, node, list(audit_side), stored[len(names):-1])
    if holder is None or audit is None:
        return False  # a result broken or gone: the apply's read deletes it
    decider = None
    decide_row = steps.rows.get((node, DECIDE))
    if holder != audit and decide_row is not None:
        decided = _cover(audit_nodes(ctx.blobs, job.id, job.step, info.spec.shards, node,
                                     DECIDE), node)
        if decided is not None:
            decider = _digest(ctx, info, node, list(decided), ctx.blobs.get_many(
                list(decided.values())))
    verdict = judge(holder, audit, decider)
    if verdict is Verdict.AGREE:
        count("phalanx_audits", "agreed")
        ctx.blobs.set(agreed_key, seen)
        return True
    if verdict is Verdict.DECIDE:
        if decide_row is None:
            count("phalanx_audits", "mismatch")
        if decide_row is None or decide_row not in steps.holders:
            _assign(ctx, steps, node, DECIDE, {auditor, *(steps.by[n] or "" for n in inside)},
                    replacing=decide_row)
        return False
    return _settle(ctx, steps, node, inside, auditor, decide_row or "", verdict,
                   (holder, audit, decider))


def _covers(found: Mapping[Node, str], node: Node) -> bool:
    return _cover(found, node) is not None


def _cover(found: Mapping[Node, str], node: Node) -> dict[Node, str] | None:
    """Stored results that make up `node` once each, the largest preferred (an auditor's
    earlier audit of a part of it may be stored beside the whole); None when some shard of
    it has none."""
    if node in found:
        return {node: found[node]}
    lo, hi = node
    if hi - lo < 2:
        return None
    mid = tree.split(lo, hi)
    left, right = _cover(found, (lo, mid)), _cover(found, (mid, hi))
    return None if left is None or right is None else {**left, **right}


def _digest(ctx: SchedulerContext, info: JobInfo, node: Node, parts: list[Node],
            stored: list[bytes | memoryview | None]) -> bytes | None:
    """SHA-256 of one side's result for `node` (its parts added up the tree, as the step
    adds them): gradient and statistics bytes, loss, correct and count. None: one is gone."""
    refs = []
    for data in stored:
        try:
            refs.append(body_key_of(data) if data is not None else None)
        except GradBlobError:
            return None
    bodies = fetch_bodies(ctx.blobs, sorted({r for r in refs if r}))
    results: list[ShardResult] = []
    for (lo, hi), data, ref in zip(parts, stored, refs):
        if data is None:
            return None
        try:
            result = unpack(data, info.model.n_params, info.model.n_stats,
                            bodies.get(ref) if ref else None)
        except GradBlobError:
            return None
        results.append(replace(result, shard=lo, span=hi - lo))
    whole = reduce_results(results, *node, info.spec.upload_precision)
    return result_digest(whole)


def result_digest(r: ShardResult) -> bytes:
    h = hashlib.sha256()
    h.update(memoryview(r.grad_sum.astype("<f4", copy=False)).cast("B"))
    h.update(memoryview(r.stats.astype("<f4", copy=False)).cast("B"))
    h.update(struct.pack("<dqq", float(r.loss_sum), int(r.correct), int(r.count)))
    return h.digest()


# -- waiting for audits -----------------------------------------------------------------------

def _wait_for(ctx: SchedulerContext, steps: StepAudits, missing: list[Node],
              waiting: bool) -> None:
    """Audits the step still needs: assigned where none is, given to another device where the
    auditor left the job or is late; the step's claim dropped, so the audit's upload applies
    the step at once."""
    job = steps.job
    late = _late(ctx, steps)
    awaited: list[Node] = []
    for node in missing:
        row = next(((a, auditor) for (a, role), auditor in steps.rows.items()
                    if role == AUDIT and a[0] <= node[0] and node[1] <= a[1]
                    and _comparable(steps, a, auditor) is not None), None)
        if row is None:
            _assign(ctx, steps, node, AUDIT, {steps.by[node] or ""})
            continue
        awaited.append(row[0])
        left = row[1] not in steps.holders
        if left or (late and ctx.blobs.set_if_absent(  # a late auditor is replaced once
                keys.audit(job.id, job.step, row[0][0], row[0][1] - row[0][0], "moved"), b"1")):
            inside = chosen_inside(row[0], steps.chosen) or []
            _assign(ctx, steps, row[0], AUDIT, {row[1], *(steps.by[n] or "" for n in inside)},
                    replacing=row[1])
    ctx.blobs.delete(keys.apply_claim(job.id, job.step))
    if awaited and all(_covers(audit_nodes(ctx.blobs, job.id, job.step, steps.info.spec.shards,
                                           node, AUDIT), node) for node in awaited):
        # they came in while this attempt read (their uploads found the claim held): again
        if ctx.blobs.set_if_absent(keys.apply_claim(job.id, job.step), b"1",
                                   ttl=ctx.tuning.apply_claim_ttl_s):
            app.send_task("scheduler.apply_step", (job.id, job.step), queue="steps")


def _late(ctx: SchedulerContext, steps: StepAudits) -> bool:
    """Whether the step has run twice past the straggler timeout: its auditors are late (they
    compute their own shards first, then the audit)."""
    job = steps.job
    if job.step_started_at is None:
        return False
    elapsed = (ctx.clock() - job.step_started_at).total_seconds()
    devices = sorted(steps.holders)
    lat = {}
    for device, raw in zip(devices, ctx.blobs.get_many([keys.latency(job.id, d)
                                                        for d in devices])):
        try:
            lat[device] = float(raw) if raw else 0.0
        except ValueError:
            continue
    return elapsed >= 2 * straggler_timeout(expected_step_s(lat), ctx.tuning.straggler_floor_s,
                                            ctx.tuning.straggler_factor)


def _assign(ctx: SchedulerContext, steps: StepAudits, node: Node, role: str,
            not_to: set[str], replacing: str | None = None) -> str | None:
    """Give `node` of the step to a device of the job for `role` (an audit, or a decision),
    never one in `not_to`: the least loaded by the audit rows it has. None when nobody can."""
    job = steps.job
    with transaction(ctx.session_factory) as session:
        ready = set(session.scalars(select(Device.id).where(
            Device.id.in_(sorted(steps.holders)), Device.state == DeviceState.READY.value)))
        load: dict[str, float] = {}
        for (a, _), device in steps.rows.items():
            load[device] = load.get(device, 0.0) + a[1] - a[0]
        pick = least_loaded(sorted(ready - not_to - {replacing or ""}), load, {})
        if pick is None:
            log.warning("step %d of %s: nobody to %s node %s (fewer devices than the audit "
                        "needs); it waits", job.step, job.id, role, node)
            return None
        session.execute(delete(ShardAssignment).where(
            ShardAssignment.job_id == job.id, ShardAssignment.role == role,
            ShardAssignment.shard == node[0]))
        session.add(ShardAssignment(job_id=job.id, shard=node[0], device_id=pick, role=role,
                                    since_step=job.step, span=node[1] - node[0]))
        if replacing:
            events.record(session, "AuditReassigned",
                          f"step {job.step}: the audit of shards {node[0]}..{node[1] - 1} "
                          f"moved from {replacing} to {pick}", now=ctx.clock(), job_id=job.id,
                          data={"step": job.step, "node": list(node), "from": replacing,
                                "to": pick})
    steps.rows[(node, role)] = pick
    bump_version(ctx.blobs)
    return pick


# -- a mismatch decided -----------------------------------------------------------------------

def _settle(ctx: SchedulerContext, steps: StepAudits, node: Node, inside: list[Node],
            auditor: str, decider: str, verdict: Verdict,
            digests: tuple[bytes, bytes, bytes | None]) -> None:
    """Two of three agreed against one: that one is quarantined. Three different results:
    all of them are computed again (the node's holder results, audit and decision deleted)."""
    job = steps.job
    count("phalanx_audit_decisions", verdict.name.lower())
    holders = sorted({steps.by[n] or "" for n in inside})
    facts = {"step": job.step, "node": list(node), "holder": holders, "auditor": auditor,
             "decider": decider, "holder_sha256": digests[0].hex(),
             "auditor_sha256": digests[1].hex(),
             "decider_sha256": digests[2].hex() if digests[2] else None}
    if verdict is Verdict.HOLDER_LOST and len(holders) == 1:
        quarantine(ctx, steps, holders[0], node, facts, lost=digests[0], won=digests[1])
    elif verdict is Verdict.AUDITOR_LOST:
        quarantine(ctx, steps, auditor, node, facts, lost=digests[1], won=digests[0])
    else:
        _redo(ctx, steps, node, inside, facts)
    return None


def quarantine(ctx: SchedulerContext, steps: StepAudits, loser: str, node: Node, facts: dict,
               lost: bytes, won: bytes) -> None:
    """The loser cordoned with the reason (phalanx devices uncordon lifts it), a
    `ResultMismatch` event naming job, step, node and both hashes; its shards and audits of
    the job taken from it in the same transaction (nothing of it is applied again) and its
    results of the step deleted; then, when the state holds results of it no audit checked,
    the job rewound to the newest checkpoint before them."""
    job, info, now = steps.job, steps.info, ctx.clock()
    lo, hi = node
    why = (f"its result for shards {lo}..{hi - 1} of {job.id} step {job.step} (sha256 "
           f"{lost.hex()[:16]}) differs from the one two of three devices computed "
           f"({won.hex()[:16]})")
    with transaction(ctx.session_factory) as session:
        first = records.first_unaudited(session, job.id, loser)
        target = rewind_target(first, checkpoint_steps(session, job.id))
        events.record(session, "ResultMismatch",
                      f"step {job.step}, shards {lo}..{hi - 1}: {loser}'s result sha256 "
                      f"{lost.hex()} differs from {won.hex()} (two of three agree); "
                      f"{loser} quarantined" + (f"; the job resumes from step {target}, "
                                                f"before its first unaudited result (step "
                                                f"{first})" if target is not None else ""),
                      now=now, job_id=job.id, device_id=loser, kind="Warning",
                      data={**facts, "loser": loser, "rewind_to": target})
        quarantine_device(session, loser, why, now, job_id=job.id, data={**facts,
                                                                          "loser": loser})
        session.execute(delete(ShardAssignment).where(ShardAssignment.job_id == job.id,
                                                      ShardAssignment.device_id == loser))
        name = session.scalar(select(Device.name).where(Device.id == loser)) or loser
    count("phalanx_quarantines", name)
    log.warning("%s quarantined: %s", loser, why)
    _delete_results_of(ctx, job, loser)
    ctx.blobs.delete(keys.apply_claim(job.id, job.step))
    if target is not None and target < job.step:
        rewind(ctx, job, info, target, StateEvent(
            "RewoundForAudit", f"{loser} was found lying at step {job.step}; its first "
            f"unaudited result is of step {first}: resumed from "
            + (f"checkpoint step {target}" if target else "step 0 (seeded init)"),
            "Warning", {"device": loser, "lost_step": job.step, "resumed_step": target,
                        "first_unaudited": first}))
    bump_version(ctx.blobs)
    app.send_task("scheduler.reconcile", queue="control")  # its shards move at once


def _delete_results_of(ctx: SchedulerContext, job: Job, device: str) -> None:
    """Every result of the step that `device` uploaded (its own and its audits), with the
    record of who uploaded it: computed again by others."""
    prefix = f"job:{job.id}:by:{job.step}:"
    found = [k for k in ctx.blobs.step_keys(job.id, job.step, job.step + 1)
             if k.startswith(prefix)]  # the step's index, not a SCAN of the keyspace
    doomed: list[str] = []
    for key, who in zip(found, ctx.blobs.get_many(found)):
        if who is None or who.decode() != device:
            continue
        span, role = key[len(prefix):].rsplit(":", 1)
        lo, hi = (int(x) for x in span.split("-"))
        doomed += [key, keys.grad(job.id, job.step, lo, hi - lo) if role == "result"
                   else keys.audit(job.id, job.step, lo, hi - lo, role)]
    if doomed:
        ctx.blobs.delete(*doomed)


def _redo(ctx: SchedulerContext, steps: StepAudits, node: Node, inside: list[Node],
          facts: dict) -> None:
    """No two of three agree (or the holders' side came from several devices): each side of
    the node is computed again by the devices that hold it, the decision dropped."""
    job = steps.job
    lo, hi = node
    gone = [keys.grad(job.id, job.step, a, b - a) for a, b in inside]
    gone += [keys.uploader(job.id, job.step, a, b - a) for a, b in inside]
    for role in ROLES:
        for (a, b), key in audit_nodes(ctx.blobs, job.id, job.step, steps.info.spec.shards,
                                       node, role).items():
            gone += [key, keys.uploader(job.id, job.step, a, b - a, role)]
    ctx.blobs.delete(*gone, keys.apply_claim(job.id, job.step))
    with transaction(ctx.session_factory) as session:
        session.execute(delete(ShardAssignment).where(
            ShardAssignment.job_id == job.id, ShardAssignment.role == DECIDE,
            ShardAssignment.shard == lo))
        events.record(session, "ResultMismatch",
                      f"step {job.step}, shards {lo}..{hi - 1}: no two results agree (holder "
                      f"sha256 {facts['holder_sha256']}, auditor {facts['auditor_sha256']}, "
                      f"decider {facts['decider_sha256']}); every side is computed again",
                      now=ctx.clock(), job_id=job.id, kind="Warning", data=facts)
    bump_version(ctx.blobs)


# -- the commit -------------------------------------------------------------------------------

def record(session: Session, job_id: str, step: int, agreed: tuple[str, ...],
           unaudited: tuple[str, ...]) -> None:
    """Inside the step's commit: who served a step of probation, who had a result applied
    unchecked (the rewind's bound when it is found lying later)."""
    records.record_step(session, job_id, step, agreed, unaudited)

