"""A job changes state only through `transition`: from a state allowed to reach the new one,
with its expectations still true, recording its event in the same transaction; a finished job
never changes again."""

from __future__ import annotations

import ast
import datetime as dt
from pathlib import Path

import pytest
from sqlalchemy import select

from domain.store.db import make_engine, make_session_factory, transaction
from domain.store.models import Event, Job
from domain.store.states import ALLOWED, transition, update_job
from domain.store.states import Event as StateEvent
from wire.states import FINISHED_STATES, JobState

NOW = dt.datetime(2026, 12, 4, 12, 0, tzinfo=dt.timezone.utc)


@pytest.fixture
def factory(db_url: str):
    return make_session_factory(make_engine(db_url))


def new_job(factory, state: str = "Pending", step: int = 0) -> str:
    with transaction(factory) as s:
        job = Job(name="j", spec={}, state=state, priority=0, step=step, total_steps=10)
        s.add(job)
        s.flush()
        return job.id


def move(factory, job_id: str, to: JobState, **kw) -> bool:
    with transaction(factory) as s:
        return transition(s, job_id, to, StateEvent(to.value, f"to {to.value}"), now=NOW, **kw)


def state_and_events(factory, job_id: str) -> tuple[str, list[str]]:
    with factory() as s:
        job = s.get(Job, job_id)
        reasons = list(s.scalars(select(Event.reason).where(Event.job_id == job_id)
                                 .order_by(Event.id)))
        return job.state, reasons


def test_a_job_runs_pauses_runs_and_succeeds_recording_each_move(factory) -> None:
    job_id = new_job(factory)
    for to in (JobState.RUNNING, JobState.PENDING, JobState.RUNNING, JobState.SUCCEEDED):
        assert move(factory, job_id, to)
    assert state_and_events(factory, job_id) == ("Succeeded",
                                                 ["Running", "Pending", "Running", "Succeeded"])


@pytest.mark.parametrize("finished", FINISHED_STATES)
def test_a_finished_job_never_changes_again(factory, finished: str) -> None:
    job_id = new_job(factory, state=finished)
    for to in JobState:
        assert not move(factory, job_id, to), to
    assert state_and_events(factory, job_id) == (finished, [])


def test_a_move_not_in_the_table_is_refused() -> None:
    assert JobState.SUCCEEDED not in ALLOWED[JobState.PENDING]  # never Pending -> Succeeded
    assert set(ALLOWED) == {JobState.PENDING, JobState.RUNNING}


def test_a_pending_job_cannot_succeed_and_a_stale_expectation_loses(factory) -> None:
    job_id = new_job(factory, step=3)
    assert not move(factory, job_id, JobState.SUCCEEDED)
    assert not move(factory, job_id, JobState.RUNNING, expect={"step": 2})  # another moved it
    assert move(factory, job_id, JobState.RUNNING, expect={"step": 3}, reason=None)
    assert state_and_events(factory, job_id) == ("Running", ["Running"])


def test_of_two_racing_moves_one_wins(factory) -> None:
    """Cancel and success decided from the same Running row: the second finds it finished."""
    job_id = new_job(factory, state="Running")
    assert move(factory, job_id, JobState.CANCELLED)
    assert not move(factory, job_id, JobState.SUCCEEDED)
    assert state_and_events(factory, job_id) == ("Cancelled", ["Cancelled"])


def test_a_write_that_keeps_the_state_is_guarded_and_records_its_event_when_it_won(factory) -> None:
    job_id = new_job(factory, state="Running", step=4)
    renamed = StateEvent("StateRestored", "renamed", "Warning", {"step": 4})
    with transaction(factory) as s:
        assert not update_job(s, job_id, expect={"step": 3}, event=renamed, now=NOW,
                              state_nonce="lost")  # the step moved: nothing written
        assert update_job(s, job_id, expect={"step": 4, "state": ("Pending", "Running")},
                          event=renamed, now=NOW, state_nonce="n1")
        assert update_job(s, job_id, expect={"state_nonce": "n1"}, reason="waiting")
    with factory() as s:
        job = s.get(Job, job_id)
        assert (job.state, job.state_nonce, job.reason) == ("Running", "n1", "waiting")
    assert state_and_events(factory, job_id) == ("Running", ["StateRestored"])


def test_a_write_that_keeps_the_state_cannot_change_it(factory) -> None:
    job_id = new_job(factory, state="Running")
    with transaction(factory) as s, pytest.raises(ValueError, match="only through transition"):
        update_job(s, job_id, expect={}, state="Succeeded")
    assert state_and_events(factory, job_id) == ("Running", [])


def test_a_move_keeps_the_callers_own_state_expectation(factory) -> None:
    """`expect` may narrow the states a move starts from (a diverged step fails only a Running
    job): both hold, the caller's and the table's."""
    job_id = new_job(factory, state="Pending", step=2)
    assert not move(factory, job_id, JobState.FAILED, expect={"step": 2, "state": "Running"})
    assert move(factory, job_id, JobState.FAILED, expect={"step": 2, "state": "Pending"})
    assert state_and_events(factory, job_id) == ("Failed", ["Failed"])


PRODUCT = ("agent", "api", "domain", "engine", "hotstate", "phalanx", "roots", "scheduler", "wire")
WRITERS = {Path("domain/store/states.py"): "Job", Path("domain/store/events.py"): "Event"}


def test_job_rows_and_events_are_written_in_one_place_each() -> None:
    """Outside domain/store/states.py no code builds an UPDATE of jobs, and outside
    domain/store/events.py none makes an event row (the scheduler had a second of each)."""
    root = Path(__file__).resolve().parents[2]
    found = []
    for package in PRODUCT:
        for path in sorted((root / package).rglob("*.py")):
            rel = path.relative_to(root)
            for node in ast.walk(ast.parse(path.read_text(), str(rel))):
                if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name):
                    continue
                table = (node.args[0].id if node.func.id in {"update", "insert"} and node.args
                         and isinstance(node.args[0], ast.Name) else None)
                made = "Event" if node.func.id == "Event" and any(
                    k.arg == "ts" for k in node.keywords) else None
                for model in {table, made} & {"Job", "Event"}:
                    if WRITERS.get(rel) != model:
                        found.append(f"{rel}:{node.lineno} writes {model}")
    assert not found, found
