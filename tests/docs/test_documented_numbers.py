"""Every number the docs promise, read from the sentence that promises it and compared with the
constant the code uses (issue 44 item 1): a change to either side fails here, naming both.

The settings tables are generated (scripts/docs_tables.py, tests/docs/test_generated_tables.py);
these are the numbers quoted in prose. A claim's pattern is matched against the doc with its
whitespace collapsed (line breaks are spaces); each `(\\d+)` group is one number, compared with
the code's value at the same place. What the numbers mean at their boundaries is pinned by the
behaviour tests each claim names."""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass

import pytest

from agent.config import AgentConfig
from agent.probes.termux import TermuxBattery
from agent.runtime import logring, work
from api import auth
from api.error_responses import STATUS
from api.routes import ui
from api.schemas.devices import LogLine, LogsIn
from domain.errors import Forbidden, NotFound
from domain.settings import Settings
from domain.store import energy, uploads
from domain.store.heartbeats import MAX_CLOCK_AHEAD_S
from hotstate import version
from scheduler.policy.eviction import EvictionLimits
from scheduler.tasks import reconcile
from tests.docs import tables
from tests.support.server import REPO_ROOT
from wire import buffers

MiB = 1024 * 1024
DEFAULTS = Settings.model_construct()  # the defaults, without this process's environment
TUNING = tables.Tuning.model_construct()  # the scheduler's knobs, where the script finds them
EVICTION = EvictionLimits()


@dataclass(frozen=True)
class Claim:
    doc: str
    pattern: str
    code: Callable[[], tuple[float, ...]]
    pinned_by: str = ""  # the test that holds the number at its boundary


def max_length(model, field: str) -> int:
    return next(m.max_length for m in model.model_fields[field].metadata
                if getattr(m, "max_length", None) is not None)


CLAIMS = {
    "token cache": Claim(
        "docs/api.md", r"caches a token lookup for up to (\d+) s: a revoked token stops working "
        r"at once on the process that revoked it and within (\d+) s on the others",
        lambda: (auth.TOKEN_CACHE_TTL_S, auth.TOKEN_CACHE_TTL_S),
        "tests/api/test_token_cache.py"),
    "token cache, contracts": Claim(
        "docs/contracts.md", r"cached in memory per process for up to (\d+) s "
        r"\(`api.auth.TOKEN_CACHE_TTL_S`\)", lambda: (auth.TOKEN_CACHE_TTL_S,)),
    "vouched token": Claim(
        "docs/api.md", r"A token found valid within the last (\d+) minutes is not looked up "
        r"again there", lambda: (auth.VOUCHED_TTL_S / 60,)),
    "clock ahead": Claim(
        "docs/api.md", r"A heartbeat with a sample dated more than (\d+) s after the server's "
        r"clock is refused whole", lambda: (MAX_CLOCK_AHEAD_S,),
        "tests/store/test_rules.py::test_a_sample_at_most_300_s_ahead_is_taken"),
    "log ring, api": Claim(
        "docs/api.md", r"`level` ≤ (\d+) without control characters, `message` ≤ (\d+); its "
        r"ring: the last (\d+) lines of INFO and up, each cut at (\d+) characters; ≤ (\d+) lines",
        lambda: (max_length(LogLine, "level"), max_length(LogLine, "message"), logring.CAPACITY,
                 logring.MAX_CHARS, max_length(LogsIn, "lines")),
        "tests/agent/test_logring.py"),
    "log ring, agent": Claim(
        "docs/agent.md", r"the agent keeps its last (\d+) lines \(INFO and up\)",
        lambda: (logring.CAPACITY,), "tests/agent/test_logring.py"),
    "lease grace": Claim(
        "docs/api.md", r"no heartbeat for more than `lease_grace_s` \(default (\d+) s, "
        r"`PHALANX_LEASE_GRACE_S`\)", lambda: (DEFAULTS.lease_grace_s,),
        "tests/store/test_rules.py::test_a_lease_exactly_the_grace_old_is_still_fresh"),
    "reconcile period": Claim(
        "docs/api.md", r"every `PHALANX_RECONCILE_INTERVAL_S`, default (\d+) s",
        lambda: (DEFAULTS.reconcile_interval_s,)),
    "eviction, api": Claim(
        "docs/api.md", r"When more than (\d+)% of a fleet of (\d+) or more is `NotReady`, the "
        r"scheduler moves shards off lease-lost devices at most (one) device per (\d+) s",
        lambda: (EVICTION.disrupted_fraction * 100, EVICTION.min_fleet,
                 EVICTION.disrupted_per_window, TUNING.eviction_window_s),
        "tests/scheduler/test_policy_boundaries.py"),
    "eviction window, scheduler": Claim(
        "docs/scheduler.md", r"evictions are limited to (\d+) per (\d+) s",
        lambda: (EVICTION.disrupted_per_window, TUNING.eviction_window_s),
        "tests/scheduler/test_policy_boundaries.py"),
    "heartbeat interval": Claim(
        "docs/api.md", r"`heartbeat_interval_s` \(default (\d+) s, `PHALANX_HEARTBEAT_INTERVAL_S`\)",
        lambda: (DEFAULTS.heartbeat_interval_s,)),
    "agent's first heartbeat interval": Claim(
        "docs/deploy.md", r"`PHALANX_HEARTBEAT_INTERVAL_S` \| (\d+) \|",
        lambda: (AgentConfig.__dataclass_fields__["heartbeat_interval_s"].default,)),
    "upload limit, gradients": Claim(
        "docs/api.md", r"body: encoded shard results \(≤ (\d+) MiB\)",
        lambda: (DEFAULTS.max_upload_bytes / MiB,)),
    "upload limit, datasets": Claim(
        "docs/api.md", r"`file` \(an `.npz`, ≤ (\d+) MiB", lambda: (DEFAULTS.max_upload_bytes / MiB,)),
    "resumable uploads": Claim(
        "docs/api.md", r"one after it stored the dataset, for (\d+) h, is 409 naming it .* a "
        r"token has at most (\d+) open \(409 past that\); one nobody added to for (\d+) h is "
        r"dropped", lambda: (uploads.UPLOAD_TTL_S / 3600, uploads.OPEN_PER_OWNER,
                             uploads.UPLOAD_TTL_S / 3600)),
    "ui": Claim(
        "docs/api.md", r"reload themselves every (\d+) s while there is something to follow.* "
        r"\(Secure over TLS, (\d+) h\)", lambda: (ui.REFRESH_S, ui.COOKIE_MAX_AGE_S / 3600)),
    "compute tries, api": Claim(
        "docs/api.md", r"the same way (\d+) times running, each try in a fresh worker: the reason "
        r"is then .*\(the same on (\d+) tries\)",
        lambda: (work.COMPUTE_TRIES, work.COMPUTE_TRIES)),
    "compute tries, scheduler": Claim(
        "docs/scheduler.md", r"same step (\d+) times running \(`COMPUTE_TRIES`\)",
        lambda: (work.COMPUTE_TRIES,)),
    "stragglers": Claim(
        "docs/scheduler.md", r"`max\(floor, (\d+) x the median .* Knobs: "
        r"`PHALANX_SCHED_STRAGGLER_FLOOR_S` \((\d+) s\), `PHALANX_SCHED_STRAGGLER_FACTOR` \((\d+)\)",
        lambda: (TUNING.straggler_factor, TUNING.straggler_floor_s, TUNING.straggler_factor)),
    "apply claim": Claim(
        "docs/scheduler.md", r"the claim expires \(`PHALANX_SCHED_APPLY_CLAIM_TTL_S`, (\d+) s\)",
        lambda: (TUNING.apply_claim_ttl_s,)),
    "version poll": Claim(
        "docs/scheduler.md", r"the poll is a (\d+\.\d+) s safety net",
        lambda: (version.SAFETY_POLL_S,)),
    "history pruning": Claim(
        "docs/deploy.md", r"older ones are deleted by reconcile \(every (\d+) minutes\)",
        lambda: (reconcile.HISTORY_PRUNE_EVERY_S / 60,)),
    "telemetry pruning": Claim(
        "docs/deploy.md", r"deleted by reconcile \(at most once every (\d+) s,",
        lambda: (reconcile.PRUNE_EVERY_S,)),
    "energy": Claim(
        "docs/deploy.md", r"gaps over (\d+) s skipped.* or (\d+) minutes after the end",
        lambda: (energy.MAX_POWER_GAP_S, energy.ENERGY_SETTLE_S / 60)),
    "buffer pool": Claim(
        "docs/deploy.md", r"one not handed out for (\d+) s is let go", lambda: (buffers.IDLE_S,)),
    "agent requests": Claim(
        "docs/agent.md", r"requests of about (\d+) s of compute", lambda: (work.CHUNK_TARGET_S,)),
    "held partials": Claim(
        "docs/agent.md", r"no longer than (\d+\.\d+) x the last pass took",
        lambda: (work.HOLD_FACTOR,)),
    "tenancy": Claim(
        "docs/api.md", r"Another user's resource answers (\d+), word for word what a resource "
        r"that does not exist answers .* one shared with them but not theirs is (\d+) to change",
        lambda: (STATUS[NotFound], STATUS[Forbidden]),
        "tests/security/test_cross_token.py, tests/store/test_rules.py"),
    "tenancy, jobs": Claim(
        "docs/api.md", r"another user's job answers (\d+) as if it did not exist.* "
        r"`POST /v1/jobs/\{id\}/cancel` \| 200, .*?; (\d+) when a user names another user's job",
        lambda: (STATUS[NotFound], STATUS[NotFound]), "tests/security/test_cross_token.py"),
    "token rotation grace": Claim(
        "docs/deploy.md", r"`PHALANX_DEVICE_TOKEN_ROTATION_GRACE_S` \| (\d+) \(24 h\)",
        lambda: (DEFAULTS.device_token_rotation_grace_s,),
        "tests/api/test_token_rotation.py"),
    "termux": Claim(
        "docs/agent.md", r"`termux-battery-status` \((\d+) s timeout; a hang is killed with its "
        r"process group and the API is skipped for (\d+) s\)",
        lambda: (AgentConfig.__dataclass_fields__["termux_timeout_s"].default,
                 inspect.signature(TermuxBattery).parameters["retry_after_s"].default)),
}
WORDS = {"one": 1, "two": 2, "three": 3}


def said(claim: Claim) -> tuple[float, ...]:
    text = " ".join((REPO_ROOT / claim.doc).read_text().split())
    found = re.search(claim.pattern, text)
    assert found, (f"{claim.doc} no longer says /{claim.pattern}/: if the sentence changed, "
                   "change its claim in this file (and keep its number checked)")
    return tuple(float(WORDS.get(g, g)) for g in found.groups())


@pytest.mark.parametrize("name", CLAIMS)
def test_a_documented_number_is_the_code_s(name: str) -> None:
    claim = CLAIMS[name]
    code = tuple(float(v) for v in claim.code())
    assert said(claim) == pytest.approx(code, rel=1e-12), (f"{claim.doc} says {said(claim)} where the code says {code} "
                                 f"({name}; pinned by {claim.pinned_by or 'this test'})")


def test_the_scheduler_s_eviction_window_is_the_policy_s_default() -> None:
    """Two defaults for one number (the policy's dataclass, the scheduler's knob): they agree."""
    assert TUNING.eviction_window_s == EVICTION.window_s
