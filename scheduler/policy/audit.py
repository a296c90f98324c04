"""Audits (DESIGN.md invariant 7): which upload nodes a second phone computes again, who does,
and whose result wins when they differ. Pure functions of their inputs, no I/O.

The unit audited is what a phone uploads: the shards it holds pre-added into the largest nodes
of the canonical reduction tree they fill (engine.tree.cover), a pure function of its held set,
so the scheduler knows every holder's nodes before the step. Each node is drawn with
probability `rate`, from a keyed hash of (step, node) under the job's audit key, a secret the
server keeps (never the job's seed, which every phone reads in its assignment): the holder
cannot tell whether a node is audited, and its upload is the same either way. A device on
probation has every node audited.
"""

from __future__ import annotations

import enum
import hashlib
import math
from collections.abc import Collection, Iterable, Mapping, Sequence

from engine import tree

Node = tuple[int, int]  # a shard range [lo, hi) that is a node of the tree


def drawn(audit_key: str, step: int, node: Node, rate: float) -> bool:
    """Whether `node` of `step` is audited: a keyed BLAKE2b of (step, node) read as a uniform
    number in [0, 1), below `rate`. The same answer on every replica and worker, for ever."""
    if rate <= 0:
        return False
    if rate >= 1:
        return True
    mac = hashlib.blake2b(f"{step}:{node[0]}:{node[1]}".encode(), digest_size=8,
                          key=audit_key.encode()[:64])
    return int.from_bytes(mac.digest(), "big") < rate * 2.0 ** 64


def on_probation(verified_steps: Mapping[str, int], devices: Iterable[str],
                 probation_steps: int) -> frozenset[str]:
    """The devices whose every node is audited: fewer than `probation_steps` of their steps were
    audited and agreed (a device never seen has none)."""
    return frozenset(d for d in devices if verified_steps.get(d, 0) < probation_steps)


def needs_audit(audit_key: str, step: int, node: Node, rate: float, holder: str | None,
                probation: Collection[str]) -> bool:
    """A node is audited when drawn, or when its holder is on probation. A result whose
    uploader is unknown (stored by a server from before audits) is not: nobody to quarantine."""
    if holder is None:
        return False
    return holder in probation or drawn(audit_key, step, node, rate)


def plan_audits(primaries: Mapping[int, str], shards: int, audit_key: str, step: int,
                rate: float, probation: Collection[str],
                speeds: Mapping[str, float] | None = None) -> dict[Node, tuple[str, str]]:
    """The audits of `step`: node -> (holder, auditor), for every node a holder will upload
    (the cover of its primary shards) that needs an audit. Each goes to the device of the job,
    other than its holder, with the least work per unit of speed so far (its own shards plus
    the audits given to it), ties in device order: audits spread over the fleet, so rate r
    costs about r of its compute. A job of one device has nobody to audit it: none."""
    held: dict[str, list[int]] = {}
    for shard, device in primaries.items():
        held.setdefault(device, []).append(shard)
    devices = sorted(held)
    speed = {d: max(1e-9, float((speeds or {}).get(d, 1.0))) for d in devices}
    work = {d: float(len(held[d])) for d in devices}
    plan: dict[Node, tuple[str, str]] = {}
    for holder in devices:
        for node in tree.cover(held[holder], shards):
            if not needs_audit(audit_key, step, node, rate, holder, probation):
                continue
            auditor = least_loaded([d for d in devices if d != holder], work, speed)
            if auditor is None:
                continue
            work[auditor] += node[1] - node[0]
            plan[node] = (holder, auditor)
    return plan


def least_loaded(candidates: Sequence[str], work: Mapping[str, float],
                 speed: Mapping[str, float]) -> str | None:
    """The candidate with the least work per unit of speed (ties: the first); None if none."""
    if not candidates:
        return None
    return min(candidates, key=lambda d: (work.get(d, 0.0) / speed.get(d, 1.0),
                                          candidates.index(d)))


def chosen_inside(audited: Node, chosen: Collection[Node]) -> list[Node] | None:
    """The step's chosen results (a cover of every shard by nodes) that make up `audited`; None
    when a chosen result holds more than it (a larger node uploaded instead: what the audit
    computed cannot be compared with it)."""
    lo, hi = audited
    inside = []
    for a, b in chosen:
        if a <= lo and hi <= b and (a, b) != audited:
            return None
        if lo <= a and b <= hi:
            inside.append((a, b))
    return sorted(inside)


class Verdict(enum.Enum):
    AGREE = "agree"  # the holder's and the auditor's results are the same bytes
    DECIDE = "decide"  # they differ: a third device computes the node
    HOLDER_LOST = "holder lost"  # the decider agrees with the auditor
    AUDITOR_LOST = "auditor lost"  # the decider agrees with the holder
    NO_MAJORITY = "no majority"  # three different results: all computed again


def judge(holder: bytes, auditor: bytes, decider: bytes | None) -> Verdict:
    """Two of three decide: each argument is a digest of one side's result for the node."""
    if holder == auditor:
        return Verdict.AGREE
    if decider is None:
        return Verdict.DECIDE
    if decider == auditor:
        return Verdict.HOLDER_LOST
    if decider == holder:
        return Verdict.AUDITOR_LOST
    return Verdict.NO_MAJORITY


def rewind_target(first_unaudited: int | None, checkpoints: Iterable[int]) -> int | None:
    """Where a job resumes once a device is found lying: None when every result of it that the
    state holds was audited (nothing to undo); else the newest checkpoint at or before its
    first unaudited result's step (state s holds the results of steps < s), step 0's seeded
    initial state when there is none."""
    if first_unaudited is None:
        return None
    return max([c for c in checkpoints if 0 <= c <= first_unaudited], default=0)


def p_uncaught(rate: float, nodes_per_step: int, steps: int) -> float:
    """The chance that a device lying on every one of its `nodes_per_step` upload nodes is not
    audited once in `steps` steps (after its probation): (1 - r)^(n T)."""
    return (1.0 - rate) ** (nodes_per_step * steps)


def steps_to_catch(rate: float, nodes_per_step: int, confidence: float = 0.99) -> int:
    """Steps after which such a device is caught with `confidence`: the least T with
    (1 - r)^(n T) <= 1 - confidence."""
    if rate >= 1:
        return 1
    if rate <= 0 or nodes_per_step < 1:
        raise ValueError("a liar is never audited at rate 0 without probation")
    steps = max(1, math.ceil(math.log1p(-confidence) / (nodes_per_step * math.log1p(-rate))))
    while p_uncaught(rate, nodes_per_step, steps - 1) <= 1.0 - confidence and steps > 1:
        steps -= 1  # the logarithms' rounding, either way
    while p_uncaught(rate, nodes_per_step, steps) > 1.0 - confidence:
        steps += 1
    return steps
