"""The path of one applied step, measured: which project modules it enters, how often a call
goes back up the stack, and how often back into a module it had left (issue 43: a reader
follows a step in about a dozen files, top to bottom).

`trace_path` runs a call under `sys.setprofile` (the calling thread; the step's math runs
there too: apply_threads=1) and follows every call into a project file (a module of one of the
repository's packages; tests, the virtualenv and generated code are not): a call from a frame
of unit P into a frame of unit M != P (library frames between them are transparent) *enters*
M, and is
- a *climb* when M is already on the stack (a callback, a call back up a layer),
- a *re-entry* when M was entered before and has been left since.
It does so in two views at once:
- `files`: every project file is a unit (the brief's count);
- `reader`: the step as its reader follows it. Each module of the scheduler's task layer
  (scheduler/*.py, scheduler/tasks/*.py) is a unit; each layer below it (domain, engine,
  hotstate, wire, and scheduler/policy: the pure placement policies) is one unit, whose inside
  is its own (its modules, tests and docs): the reader reads the call into it. The goal: at
  most 12 units, no climb, and the scheduler's files a tree, each entered from one file only.
  A lower layer is a service the stages share (the blob store is read at the read stage,
  written at the store stage, bumped at publish; the engine's numerics and its spec read where
  they are needed): its re-entries are counted, not bounded.

`.venv/bin/python -m pytest -s -q -p no:xdist tests/scheduler/test_apply_path.py` prints the
numbers and the path.
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import CodeType, FrameType
from typing import Any

import pytest

from hotstate import keys
from hotstate.blobs import MemoryBlobStore
from scheduler.tasks.steps import run_apply_step
from tests.scheduler.helpers import (
    add_devices,
    assignments,
    job,
    make_ctx,
    run_to,
    start_job,
    tiny_spec,
    upload_all,
)

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = frozenset(p.name for p in ROOT.iterdir()
                     if (p / "__init__.py").exists() and p.name != "tests")
LOWER = ("domain/", "engine/", "hotstate/", "wire/", "scheduler/policy/")  # one unit each


def file_of(code: CodeType, cache: dict[CodeType, str | None]) -> str | None:
    """The project file a code object belongs to ("scheduler/tasks/steps"), or None."""
    if code not in cache:
        name = None
        path = Path(code.co_filename)
        if path.is_absolute() and path.suffix == ".py":
            try:
                rel = path.resolve().relative_to(ROOT)
            except ValueError:
                rel = None
            if rel is not None and rel.parts[0] in PACKAGES:
                name = str(rel.with_suffix(""))
        cache[code] = name
    return cache[code]


def reader_unit(name: str) -> str:
    """The reader's unit of a project file: a lower layer as a whole, else the file."""
    return next((layer.rstrip("/") for layer in LOWER if name.startswith(layer)), name)


@dataclass
class UnitPath:
    """The units one traced call went through."""

    entered: list[str] = field(default_factory=list)  # in first-entry order
    climbs: Counter[tuple[str, str]] = field(default_factory=Counter)  # (caller, callee)
    reentries: Counter[tuple[str, str]] = field(default_factory=Counter)
    callers: dict[str, set[str]] = field(default_factory=dict)  # unit -> the units calling it
    _stack: list[tuple[FrameType, str]] = field(default_factory=list)

    def enter(self, frame: FrameType, unit: str, caller: str | None) -> None:
        if caller is not None:
            self.callers.setdefault(unit, set()).add(caller)
            if any(u == unit for _, u in self._stack):
                self.climbs[(caller, unit)] += 1
            elif unit in self.entered:
                self.reentries[(caller, unit)] += 1
        if unit not in self.entered:
            self.entered.append(unit)
        self._stack.append((frame, unit))

    def leave(self, frame: FrameType) -> None:
        if self._stack and self._stack[-1][0] is frame:
            self._stack.pop()

    def fan_in(self, prefix: str = "") -> dict[str, list[str]]:
        """The units (starting with `prefix`) entered from more than one unit."""
        return {u: sorted(c) for u, c in self.callers.items()
                if len(c) > 1 and u.startswith(prefix)}

    def count(self, what: Counter[tuple[str, str]], prefix: str = "") -> int:
        return sum(n for (_, callee), n in what.items() if callee.startswith(prefix))

    def report(self, title: str) -> str:
        lines = [f"{title}: {len(self.entered)} entered, {sum(self.climbs.values())} climbs, "
                 f"{sum(self.reentries.values())} re-entries "
                 f"({self.count(self.reentries, 'scheduler/')} into scheduler files), "
                 f"{len(self.fan_in())} entered from more than one unit "
                 f"({len(self.fan_in('scheduler/'))} scheduler files)",
                 "  entered: " + " ".join(self.entered)]
        lines += [f"  climb {a} -> {b} x{n}" for (a, b), n in sorted(self.climbs.items())]
        lines += [f"  re-entry {a} -> {b} x{n}" for (a, b), n in sorted(self.reentries.items())
                  if b.startswith("scheduler/")]
        lines += [f"  fan-in {u} <- {', '.join(c)}" for u, c in sorted(self.fan_in().items())]
        return "\n".join(lines)


@dataclass
class Trace:
    files: UnitPath
    reader: UnitPath


def trace_path(call: Callable[[], Any]) -> tuple[Any, Trace]:
    """Run `call` under the profiler; its result and the path it took, in both views."""
    trace = Trace(UnitPath(), UnitPath())
    views = ((trace.files, lambda name: name), (trace.reader, reader_unit))
    cache: dict[CodeType, str | None] = {}

    def caller_file(frame: FrameType) -> str | None:
        back = frame.f_back
        while back is not None:
            name = file_of(back.f_code, cache)
            if name is not None:
                return name
            back = back.f_back
        return None

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "return":
            for path, _ in views:
                path.leave(frame)
            return
        if event != "call" or (name := file_of(frame.f_code, cache)) is None:
            return
        caller = caller_file(frame) if trace.files.entered else None
        for path, unit_of in views:
            unit, by = unit_of(name), None if caller is None else unit_of(caller)
            if unit != by:
                path.enter(frame, unit, by)

    sys.setprofile(profile)
    try:
        result = call()
    finally:
        sys.setprofile(None)
    return result, trace


def traced_step(sqlite_url: str, tmp_path: Path, step: int, joins: bool = False) -> Trace:
    """Step `step` of the tiny job (8 steps, a checkpoint every 3) applied in process and
    traced, after the steps before it ran untraced (caches warm, as in a running worker);
    `joins`: a free device joins at its boundary (reconcile flagged the job)."""
    ctx = make_ctx(sqlite_url, tmp_path, blobs=MemoryBlobStore(), apply_threads=1)
    job_id = start_job(ctx, tiny_spec())
    run_to(ctx, job_id, step)
    upload_all(ctx, job_id, step)
    if joins:
        add_devices(ctx, 1, prefix="joiner")
        ctx.blobs.set(keys.rebalance(job_id), b"1")
    outcome, trace = trace_path(lambda: run_apply_step(ctx, job_id, step))
    assert outcome == "applied" and job(ctx, job_id).step == step + 1
    assert not joins or "joiner-00" in {d for _, d, _ in assignments(ctx, job_id)}
    return trace


# reader view, as reached after the pipeline (scheduler.apply): units entered, and re-entries
# into scheduler files (each from that file's one caller, at a later stage of it: the pipeline
# calls recovery to read state t and again to drop step t's keys, checkpoints to write the file
# and again for its row and pruning; the boundary calls store_ops and the policies in turn).
# Before it (3242573): 12 / 12 / 9 / 13 units, 2 climbs each (the engine and the commit called
# back into scheduler/tasks/steps), 4 / 7 / 5 / 15 re-entries, steps and checkpoints (and, when
# a device joins, store_ops) entered from two files. The files view (every project file its
# own unit; most of it the engine's and the hot state's insides) is printed, not bounded:
# before 27 / 31 / 35 / 36 files, 7 climbs, 85 / 102 / 129 / 153 re-entries; after 26 / 31 /
# 36 / 37, 5 (all inside the engine), 86 / 103 / 131 / 152.
STEPS = {
    "a step": (1, False, 9, 1),
    "a checkpointed step": (2, False, 10, 3),
    "the final step": (7, False, 9, 3),
    "a step at which a device joins": (1, True, 11, 9),
}


@pytest.mark.parametrize("what", list(STEPS))
def test_a_reader_follows_one_applied_step_through_at_most_12_units_top_to_bottom(
        sqlite_url: str, tmp_path: Path, what: str) -> None:
    step, joins, units, reentries = STEPS[what]
    trace = traced_step(sqlite_url, tmp_path, step, joins)
    print(f"\n{trace.files.report(what + ', files')}\n{trace.reader.report(what + ', reader')}")
    reader = trace.reader
    assert len(reader.entered) <= min(units, 12), reader.entered
    assert not reader.climbs, reader.climbs  # nothing calls back up into the pipeline
    assert not reader.fan_in("scheduler/"), reader.fan_in("scheduler/")  # a tree of files
    assert reader.count(reader.reentries, "scheduler/") <= reentries, reader.reentries
