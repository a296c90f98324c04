"""A job changes state only through `transition`: from a state allowed to reach the new one,
with its expectations still true, recording its event in the same transaction; a finished job
never changes again."""

from __future__ import annotations

import datetime as dt

import pytest
from sqlalchemy import select

from domain.store.db import make_engine, make_session_factory, transaction
from domain.store.models import Event, Job
from domain.store.states import ALLOWED, transition
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
