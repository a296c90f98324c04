"""Names of the hot-state keys (docs/contracts.md lists the first two)."""

from __future__ import annotations

import uuid

VERSION = "sched:version"  # bumped on any step or assignment change: wakes long polls
SLICES_VERSION = "sched:slices-version"  # bumped when a slice of a step is applied
PLACEMENT_LOCK = "sched:lock:placement"
RECONCILE_ASKED = "sched:reconcile:asked"  # dedups API hooks' reconcile requests
TELEMETRY_PRUNED = "sched:telemetry:pruned"  # set for PRUNE_EVERY_S after a prune: one per window
HISTORY_PRUNED = "sched:history:pruned"  # the same for events and step metrics (less often)
EVICTIONS = "sched:evictions"  # JSON list of recent NotReady eviction times (rate limit)


def peer_down(address: str) -> str:
    """Set for a while when a replica's peer port could not be reached (hotstate.bodies)."""
    return f"sched:peer-down:{address}"


def state(job_id: str, step: int, nonce: str | None) -> str:
    """The state of `step` that the job's row names (`jobs.state_nonce`): each apply or restore
    writes its own, and only the one whose commit won is ever read. No nonce: the name before
    nonces (a job running across the upgrade keeps its state)."""
    if nonce is None:
        return f"job:{job_id}:state:{step}"
    return f"job:{job_id}:state:{step}:{nonce}"


def state_slice(job_id: str, step: int, nonce: str | None, index: int) -> str:
    """Slice `index`'s part of the state of `step` (a job with slices > 1: engine.slices)."""
    return f"{state(job_id, step, nonce)}:s{index}"


def state_keys(job_id: str, step: int, nonce: str | None, slices: int) -> list[str]:
    """Every key the state of `step` is stored under: one, or one per slice (written by
    separate tasks: hotstate.trainstate.state_stored checks them all)."""
    if slices == 1:
        return [state(job_id, step, nonce)]
    return [state_slice(job_id, step, nonce, i) for i in range(slices)]


def slice_plan(job_id: str, step: int, nonce: str | None) -> str:
    """A sliced step's plan, made once by whoever starts applying it: the results every slice
    reads (one cover of the tree) and the nonce the slices of step + 1 are stored under.
    Keyed by the state it applies to (`nonce`): a rewound job's step is another plan."""
    return f"job:{job_id}:slices:{step}:{nonce}"


def slice_done(job_id: str, step: int, plan_nonce: str, index: int) -> str:
    """Set once slice `index` of the plan naming `plan_nonce` (the state step + 1 is stored
    under) is stored: a plan made again after a lost result counts its own slices only."""
    return f"job:{job_id}:slices:{step}:done:{plan_nonce}:{index}"


def slice_claim(job_id: str, step: int, plan_nonce: str, index: int) -> str:
    """Set when slice `index` of the plan naming `plan_nonce` is sent to a worker; expires so a
    lost one is resent (a plan made again sends its own at once)."""
    return f"{apply_claim(job_id, step)}:{plan_nonce}:s{index}"


def new_nonce() -> str:
    return uuid.uuid4().hex[:16]


def grad(job_id: str, step: int, shard: int, span: int = 1) -> str:
    """A shard's result, or (span > 1) a partial of shards shard..shard+span-1 (engine.tree):
    `...:5` or `...:4-8`."""
    return f"job:{job_id}:grad:{step}:{shard}" + (f"-{shard + span}" if span != 1 else "")


def audit(job_id: str, step: int, shard: int, span: int, role: str) -> str:
    """A second (role `audit`) or third (`decide`) device's result for node shard..shard+span-1
    of the step (scheduler.audits): stored apart, never over the holder's `grad` key, and
    never added into the step; only compared with it."""
    return f"job:{job_id}:audit:{step}:{shard}-{shard + span}:{role}"


def audits_planned(job_id: str, step: int) -> str:
    """Set once the audits of `step` are assigned (scheduler.audits): reconcile assigns them
    for a step that no step boundary planned (a job's first, a resumed or rewound one)."""
    return f"job:{job_id}:audit:{step}:planned"


def uploader(job_id: str, step: int, shard: int, span: int, role: str = "result") -> str:
    """The device whose upload won the `grad` key (role `result`) or an audit key of that
    node: whom an audit finds lying, and whose unaudited results a checkpoint holds."""
    return f"job:{job_id}:by:{step}:{shard}-{shard + span}:{role}"


def covered(job_id: str, step: int) -> str:
    """The shards of every result stored for the step, added up (gradstore.covered_at_most)."""
    return f"job:{job_id}:covered:{step}"


def upload_body(job_id: str, step: int, upload_id: str) -> str:
    """One upload's message as it arrived; the shards it won point into it (gradstore)."""
    return f"job:{job_id}:body:{step}:{upload_id}"


def grad_prefix(job_id: str, step: int) -> str:
    return f"job:{job_id}:grad:{step}:"


def job_prefix(job_id: str) -> str:
    return f"job:{job_id}:"


def step_index(job_id: str) -> str:
    """A sorted set of the job's per-step keys (those step_of_key reads), scored by step:
    hotstate.blobs adds a key in the transaction that writes it and removes it in the one that
    deletes it, so a step's keys are dropped without a SCAN of the keyspace. Outside the job's
    prefix: `keys(job_prefix)` lists strings only."""
    return f"steps:{job_id}"


def indexed_step(key: str) -> tuple[str, int] | None:
    """(the job's step index, the step) of a per-step key; None for any other key."""
    step = step_of_key(key)
    return None if step is None else (step_index(key.split(":", 2)[1]), step)


def apply_claim(job_id: str, step: int) -> str:
    """Set when apply_step(job, step) is enqueued; expires so a lost task is re-enqueued."""
    return f"job:{job_id}:apply:{step}"


def apply_due(job_id: str, step: int) -> str:
    """Set by the reconcile pass that first sees the step complete and unapplied: a later pass
    sends it to the workers (scheduler.tasks.reconcile)."""
    return f"{apply_claim(job_id, step)}:due"


def reconcile_claim(job_id: str) -> str:
    return f"job:{job_id}:reconcile"


def rebalance(job_id: str) -> str:
    """Set by reconcile when a running job should take new devices at its next step boundary."""
    return f"job:{job_id}:rebalance"


def latency(job_id: str, device_id: str) -> str:
    """Seconds from step start to this device's last upload: its measured step time."""
    return f"job:{job_id}:lat:{device_id}"


def late_steps(job_id: str, device_id: str) -> str:
    """JSON list of the recent steps at which this device needed backups."""
    return f"job:{job_id}:late:{device_id}"


def slow_factor(job_id: str, device_id: str) -> str:
    """How much this device's speed is discounted for this job after persistent lateness."""
    return f"job:{job_id}:slow:{device_id}"


def step_of_key(key: str) -> int | None:
    """The step number in a `job:{id}:state:{t}`, `...:grad:{t}:{k}`, `...:covered:{t}`,
    `...:body:{t}:{upload}`, `...:audit:{t}:...` or `...:by:{t}:...` key."""
    parts = key.split(":")
    if len(parts) >= 4 and parts[2] in ("state", "weights", "grad", "body", "apply", "slices",
                                        "covered", "audit", "by"):
        try:
            return int(parts[3])
        except ValueError:
            return None
    return None
