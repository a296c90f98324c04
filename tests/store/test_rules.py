"""The store's rules at their boundaries (issue 44 item 2), each as the docs state it:

- a device is NotReady after "no heartbeat for more than `lease_grace_s`": a lease exactly the
  grace old is still fresh (docs/api.md, "States and lifecycle"); NotReady wins over the admin
  flags, then Draining, then Cordoned;
- "a sample dated more than 300 s after the server's clock is refused whole" (docs/api.md);
- label selectors as Kubernetes writes them, the Python and the SQL saying the same
  (docs/api.md, `GET /v1/devices`);
- tenancy: another user's resource is not found, a shared one not theirs is forbidden to change
  (docs/api.md, "Tenancy").

These are also the tests `scripts/mutation store` judges the rules by (docs/testing.md)."""

from __future__ import annotations

import datetime as dt
import threading
from types import SimpleNamespace

import pytest
from sqlalchemy import select, text, update
from sqlalchemy.exc import OperationalError

from domain.errors import Forbidden, Invalid, NotFound
from domain.settings import Settings
from domain.store import lifecycle, owners
from domain.store.db import make_engine, make_session_factory, transaction
from domain.store.heartbeats import check_clock
from domain.store.models import Dataset, Device, Event, Job
from domain.store.selectors import Requirement, matches, parse_selector, sql_conditions
from domain.store.states import Event as JobEvent
from domain.store.states import transition, update_job
from domain.store.tokens import Principal
from wire.states import JobState

NOW = dt.datetime(2026, 12, 7, 12, 0, tzinfo=dt.timezone.utc)
GRACE = Settings.model_construct().lease_grace_s
MS = dt.timedelta(milliseconds=1)


@pytest.fixture
def factory(sqlite_url: str):
    engine = make_engine(sqlite_url)
    yield make_session_factory(engine)
    engine.dispose()


def add_device(factory, name: str, lease: dt.datetime | None, **columns) -> str:
    with transaction(factory) as session:
        device = Device(name=name, lease_renewed_at=lease, **columns)
        session.add(device)
        session.flush()
        return device.id


def utc(t: dt.datetime) -> dt.datetime:
    """A stored time as an aware UTC one (SQLite gives it back naive)."""
    return t.replace(tzinfo=dt.timezone.utc) if t.tzinfo is None else t


def device_states(factory) -> dict[str, str]:
    with factory() as session:
        return {d.name: d.state for d in session.scalars(select(Device))}


def reasons(factory, device_id: str) -> list[str]:
    with factory() as session:
        return list(session.scalars(select(Event.reason).where(Event.device_id == device_id)
                                    .order_by(Event.id)))


# --- node lifecycle -------------------------------------------------------------------------

@pytest.mark.parametrize("fresh, cordoned, draining, state", [
    (True, False, False, "Ready"),
    (True, True, False, "Cordoned"),
    (True, True, True, "Draining"),
    (True, False, True, "Draining"),
    (False, True, True, "NotReady"),
    (False, True, False, "NotReady"),
    (False, False, False, "NotReady"),
])
def test_notready_wins_over_draining_which_wins_over_cordoned(fresh, cordoned, draining,
                                                              state) -> None:
    assert lifecycle.derive_state(fresh, cordoned, draining) == state


def test_a_lease_exactly_the_grace_old_is_still_fresh(db_url: str) -> None:
    """docs/api.md: NotReady after "no heartbeat for more than lease_grace_s" (default 40 s):
    at 40 s the device stays, 1 ms past it goes, on both databases."""
    engine = make_engine(db_url)
    factory = make_session_factory(engine)
    at = add_device(factory, "at", NOW - dt.timedelta(seconds=GRACE))
    past = add_device(factory, "past", NOW - dt.timedelta(seconds=GRACE) - MS)
    never = add_device(factory, "never", None)
    flagged = add_device(factory, "flagged", NOW - dt.timedelta(hours=1), state="Draining",
                         cordoned=True, draining=True)
    add_device(factory, "gone", NOW - dt.timedelta(hours=1), state="NotReady")
    with transaction(factory) as session:
        marked = lifecycle.mark_stale_devices(session, NOW, GRACE)
    assert marked == sorted([past, never, flagged])
    assert device_states(factory) == {"at": "Ready", "past": "NotReady", "never": "NotReady",
                                      "flagged": "NotReady", "gone": "NotReady"}
    with factory() as session:
        marked_events = list(session.scalars(select(Event).where(Event.reason == "NodeNotReady")))
        updated = {d.name: d.updated for d in session.scalars(select(Device))}
    assert {(e.message, e.kind, utc(e.ts)) for e in marked_events} == {
        (f"no heartbeat for more than {GRACE:g} s", "Warning", NOW)}
    assert utc(updated["past"]) == NOW and utc(updated["at"]) != NOW
    assert reasons(factory, at) == [] and reasons(factory, past) == ["NodeNotReady"]
    with transaction(factory) as session:  # level-triggered: the same pass again changes nothing
        assert lifecycle.mark_stale_devices(session, NOW, GRACE) == []
    assert reasons(factory, past) == ["NodeNotReady"]
    engine.dispose()


def test_cordon_drain_uncordon_record_an_event_only_when_something_changed(factory) -> None:
    dev = add_device(factory, "a", NOW)

    def act(verb):
        with transaction(factory) as session:
            device, changed = verb(session, dev, NOW)
            return device.state, device.cordoned, device.draining, changed

    assert act(lifecycle.cordon) == ("Cordoned", True, False, True)
    assert act(lifecycle.cordon) == ("Cordoned", True, False, False)
    assert act(lifecycle.drain) == ("Draining", True, True, True)
    assert act(lifecycle.drain) == ("Draining", True, True, False)
    assert act(lifecycle.cordon) == ("Draining", True, True, False)  # cordon keeps the drain
    assert act(lifecycle.uncordon) == ("Ready", False, False, True)
    assert act(lifecycle.uncordon) == ("Ready", False, False, False)
    assert reasons(factory, dev) == ["Cordoned", "Draining", "Uncordoned"]
    with factory() as session:
        messages = list(session.scalars(select(Event.message).where(Event.device_id == dev)
                                        .order_by(Event.id)))
        times = set(session.scalars(select(Event.ts).where(Event.device_id == dev)))
    assert {utc(t) for t in times} == {NOW}
    assert messages == ["cordoned: no new work is placed here",
                        "draining: cordoned, and asked to let go of its work",
                        "uncordoned: schedulable again"]


def test_an_admin_flag_on_a_notready_device_leaves_it_notready(factory) -> None:
    dev = add_device(factory, "a", None, state="NotReady")
    with transaction(factory) as session:
        device, changed = lifecycle.drain(session, dev, NOW)
        assert (device.state, changed) == ("NotReady", True)
    with transaction(factory) as session:
        device, changed = lifecycle.uncordon(session, dev, NOW)
        assert (device.state, device.cordoned, device.draining) == ("NotReady", False, False)


def test_an_unknown_device_is_not_found_by_name(factory) -> None:
    with transaction(factory) as session, pytest.raises(NotFound) as refused:
        lifecycle.cordon(session, "dev-nope", NOW)
    assert refused.value.detail == "device dev-nope not found"
    with factory() as session, pytest.raises(NotFound):
        lifecycle.get_device(session, "dev-nope", for_update=True)


def test_a_renewed_lease_shows_the_flags_of_the_row_it_updates(factory) -> None:
    ids = {name: add_device(factory, name, None, state="NotReady", **flags) for name, flags in
           {"plain": {}, "cordoned": {"cordoned": True},
            "draining": {"cordoned": True, "draining": True}}.items()}
    with transaction(factory) as session:
        session.execute(update(Device).where(Device.id.in_(ids.values()))
                        .values(state=lifecycle.leased_state_sql()))
    assert device_states(factory) == {"plain": "Ready", "cordoned": "Cordoned",
                                      "draining": "Draining"}


# --- the phone's clock ----------------------------------------------------------------------

def heartbeat(*ahead_s: float) -> SimpleNamespace:
    return SimpleNamespace(telemetry=[SimpleNamespace(ts=NOW + dt.timedelta(seconds=s))
                                      for s in ahead_s])


def test_a_sample_at_most_300_s_ahead_is_taken() -> None:
    """docs/api.md: refused when dated more than 300 s after the server's clock."""
    check_clock(heartbeat(-86400, 0, 300), NOW)  # the past, now, the limit
    with pytest.raises(Invalid) as refused:
        check_clock(heartbeat(0, 300.001, 3600), NOW)
    [error] = refused.value.detail
    assert error["field"] == "telemetry.1.ts" and error["loc"] == ["body", "telemetry", "1", "ts"]
    assert error["msg"].endswith("is ahead of the server's clock "
                                 f"({NOW.isoformat()}) by more than 300 s: set the phone's clock")


# --- label selectors ------------------------------------------------------------------------

@pytest.mark.parametrize("text, requirements", [
    (None, []),
    ("  ", []),
    ("rack=a", [Requirement("rack", "in", ("a",))]),
    ("rack == a", [Requirement("rack", "in", ("a",))]),
    ("rack!=a", [Requirement("rack", "notin", ("a",))]),
    ("rack=", [Requirement("rack", "in", ("",))]),
    ("rack in (a, b)", [Requirement("rack", "in", ("a", "b"))]),
    ("rack notin (a,b)", [Requirement("rack", "notin", ("a", "b"))]),
    ("gpu", [Requirement("gpu", "exists")]),
    ("! gpu", [Requirement("gpu", "!exists")]),
    ("zone in (x,y), rack=a,!gpu", [Requirement("zone", "in", ("x", "y")),
                                    Requirement("rack", "in", ("a",)),
                                    Requirement("gpu", "!exists")]),
    ("example.com/rack=a-1", [Requirement("example.com/rack", "in", ("a-1",))]),
])
def test_a_selector_reads_as_kubernetes_writes_it(text, requirements) -> None:
    assert parse_selector(text) == requirements


@pytest.mark.parametrize("text, msg", [
    ("rack=a,", "selector 'rack=a,' has an empty term"),
    ("rack=a,,b", "selector 'rack=a,,b' has an empty term"),
    ("rack in ()", "bad value in 'rack in ()'"),
    ("rack in (a,b c)", "bad value in 'rack in (a,b c)'"),
    ("rack in (a", "selector term 'rack in (a' is none of key=value, key!=value, "
                   "key in (a,b), key notin (a,b), key, !key"),
    ("=a", "selector term '=a' is none of key=value, key!=value, key in (a,b), key notin (a,b), "
           "key, !key"),
    ("-rack", "selector term '-rack' is none of key=value, key!=value, key in (a,b), "
              "key notin (a,b), key, !key"),
])
def test_a_term_that_is_no_selector_is_a_422_naming_it(text, msg) -> None:
    with pytest.raises(Invalid) as refused:
        parse_selector(text)
    assert refused.value.detail == [{"loc": ["query", "selector"], "field": "selector",
                                     "msg": msg, "type": "value_error"}]


LABELS = {"a": {"rack": "a", "gpu": "yes"}, "b": {"rack": "b"}, "bare": {},
          "c": {"rack": "c", "zone": "x"}}
SELECTORS = {
    "rack=a": {"a"},
    "rack!=a": {"b", "bare", "c"},  # a device without the label matches too
    "rack in (a,b)": {"a", "b"},
    "rack notin (a,b)": {"bare", "c"},
    "rack": {"a", "b", "c"},
    "!rack": {"bare"},
    "gpu,rack=a": {"a"},
    "gpu,rack=b": set(),
    "!gpu,rack notin (c)": {"b", "bare"},
    "": {"a", "b", "bare", "c"},
}


@pytest.mark.parametrize("text", SELECTORS)
def test_python_and_sql_select_the_same_devices(factory, text) -> None:
    for name, labels in LABELS.items():
        add_device(factory, name, NOW, labels=labels)
    reqs = parse_selector(text)
    assert {name for name, labels in LABELS.items() if matches(reqs, labels)} == SELECTORS[text]
    with factory() as session:
        found = set(session.scalars(select(Device.name).where(
            *sql_conditions(reqs, Device.labels))))
    assert found == SELECTORS[text]


# --- tenancy --------------------------------------------------------------------------------

ADMIN = Principal(kind="admin", name="env")
ALICE = Principal(kind="user", token_id="tok-alice", name="alice")
BOB = Principal(kind="user", token_id="tok-bob", name="alice")  # same name, another user
PHONE = Principal(kind="device", token_id="tok-dev", device_id="dev-1")


def add_datasets(factory) -> None:
    with transaction(factory) as session:
        for name, owner, public in (("alices", "tok-alice", False), ("shared", "tok-bob", True),
                                    ("admins", None, False), ("bobs", "tok-bob", False)):
            session.add(Dataset(name=name, path="p", n_samples=1, num_classes=2, sha256="0" * 64,
                                size_bytes=1, owner=owner, public=public))


def test_a_resource_records_its_user_and_none_for_an_admin() -> None:
    assert owners.owner_of(ALICE) == "tok-alice" and owners.owner_of(ADMIN) is None
    assert owners.owner_of(PHONE) is None


@pytest.mark.parametrize("who, sees", [
    (ADMIN, {"alices", "shared", "admins", "bobs"}),
    (ALICE, {"alices", "shared"}),
    (BOB, {"shared", "bobs"}),
    (PHONE, {"shared"}),
])
def test_a_user_sees_their_own_and_what_is_shared(factory, who, sees) -> None:
    add_datasets(factory)
    with factory() as session:
        rows = list(session.scalars(select(Dataset)))
        listed = set(session.scalars(select(Dataset.name).where(owners.visible(Dataset, who))))
    assert {row.name for row in rows if owners.may_see(row, who)} == sees
    assert listed == sees


def test_jobs_have_no_sharing_an_admin_s_job_is_the_admin_s(factory) -> None:
    with transaction(factory) as session:
        for owner in ("tok-alice", None):
            session.add(Job(name="j", spec={}, owner=owner))
    with factory() as session:
        for who, owners_seen in ((ALICE, {"tok-alice"}), (PHONE, set()),
                                 (ADMIN, {"tok-alice", None})):
            seen = set(session.scalars(select(Job.owner).where(owners.visible(Job, who))))
            assert seen == owners_seen, who
            assert {job.owner for job in session.scalars(select(Job))
                    if owners.may_see(job, who)} == owners_seen


def test_another_user_s_resource_is_not_found_and_a_shared_one_not_theirs_to_change(
        factory) -> None:
    add_datasets(factory)
    with factory() as session:
        for name in ("bobs", "admins", "missing"):
            with pytest.raises(NotFound) as refused:
                owners.find(session, Dataset, name, ALICE, f"dataset {name!r}")
            assert refused.value.detail == f"dataset {name!r} not found"
        assert owners.find(session, Dataset, "shared", ALICE, "d").name == "shared"
        with pytest.raises(Forbidden) as forbidden:
            owners.find_to_change(session, Dataset, "shared", ALICE, "dataset 'shared'")
        assert forbidden.value.detail == ("dataset 'shared' is not yours: only its owner or an "
                                          "admin may change it")
        assert owners.find_to_change(session, Dataset, "alices", ALICE, "d").name == "alices"
        assert owners.find_to_change(session, Dataset, "bobs", ADMIN, "d").name == "bobs"
        with pytest.raises(NotFound) as hidden:
            owners.find_to_change(session, Dataset, "bobs", ALICE, "dataset 'bobs'")
        assert hidden.value.detail == "dataset 'bobs' not found"
    admins = SimpleNamespace(owner=None, public=False)
    assert not owners.may_change(admins, ALICE) and not owners.may_change(admins, PHONE)
    assert owners.may_change(admins, ADMIN)


def test_a_flag_change_waits_for_another_writer_of_the_device(pg_url: str) -> None:
    """cordon, drain and uncordon read the device FOR UPDATE (Postgres; SQLite locks the whole
    file): while another transaction holds the row, a second flag change waits rather than
    deciding from a row about to change. A 100 ms lock timeout turns the wait into an error."""
    engine = make_engine(pg_url)
    factory = make_session_factory(engine)
    dev = add_device(factory, "a", NOW, cordoned=True, state="Cordoned")
    for verb in (lifecycle.cordon, lifecycle.drain, lifecycle.uncordon):
        with factory() as holder, factory() as other:
            lifecycle.get_device(holder, dev, for_update=True)
            other.execute(text("SET lock_timeout = '100ms'"))
            assert lifecycle.get_device(other, dev).id == dev  # a plain read does not wait
            with pytest.raises(OperationalError, match="lock timeout"):
                verb(other, dev, NOW)
            other.rollback()
            holder.rollback()
    engine.dispose()


@pytest.mark.parametrize(("verb", "reason", "start"), [
    (lifecycle.uncordon, "Uncordoned", {"cordoned": True, "state": "Cordoned"}),
    (lifecycle.drain, "Draining", {}),
])
def test_two_admins_changing_a_device_at_once_record_the_change_once(
        pg_url: str, verb, reason: str, start: dict) -> None:
    """The second reads the row after the first commits (FOR UPDATE), so it finds nothing left
    to change: one event, not a second from a row read before the first's commit."""
    engine = make_engine(pg_url)
    factory = make_session_factory(engine)
    dev = add_device(factory, "a", NOW, **start)
    second: list[bool] = []
    with factory() as first:
        assert verb(first, dev, NOW)[1]  # changed, uncommitted, the row held

        def other_admin() -> None:
            with factory() as other:
                second.append(verb(other, dev, NOW)[1])
                other.commit()

        racer = threading.Thread(target=other_admin)
        racer.start()
        racer.join(0.3)  # it waits for the row
        assert racer.is_alive()
        first.commit()
    racer.join(10)
    assert second == [False]
    assert reasons(factory, dev).count(reason) == 1
    engine.dispose()


# --- job writes -----------------------------------------------------------------------------

def test_a_guarded_job_write_refuses_a_state_and_an_event_without_its_time() -> None:
    with pytest.raises(ValueError, match=r"^a job's state changes only through transition\(\)$"):
        update_job(None, "job-x", expect={}, state="Running")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="^an event needs its time$"):
        update_job(None, "job-x", expect={}, event=JobEvent("R", "m"))  # type: ignore[arg-type]


def test_a_quarantine_cordons_with_its_reason_until_an_admin_lifts_it(factory) -> None:
    """scheduler.audits: a device whose result an audit found wrong is cordoned with the reason
    kept on it, once; uncordon lifts it, saying by whom."""
    dev = add_device(factory, "a", NOW)
    with transaction(factory) as session:
        assert lifecycle.quarantine(session, dev, "wrong result at step 4", NOW, job_id=None,
                                    data={"step": 4})
        assert not lifecycle.quarantine(session, dev, "again", NOW)  # once
        assert not lifecycle.quarantine(session, "dev-nope", "x", NOW)
    with factory() as session:
        device = session.get(Device, dev)
        assert (device.state, device.cordoned, device.quarantine_reason) == (
            "Cordoned", True, "wrong result at step 4")
        shown = [(e.reason, e.message, e.kind, e.data, utc(e.ts)) for e in session.scalars(
            select(Event).where(Event.device_id == dev).order_by(Event.id))]
    assert shown == [
        ("Quarantined", "wrong result at step 4", "Warning", {"step": 4}, NOW),
        ("Cordoned", "cordoned: quarantined (phalanx devices uncordon lifts it)", "Normal", {},
         NOW)]
    later = NOW + dt.timedelta(hours=3)  # the lift's time is the admin's, not the quarantine's
    with transaction(factory) as session:
        device, changed = lifecycle.uncordon(session, dev, later, by="alice")
        assert changed and device.quarantine_reason is None and device.state == "Ready"
    assert reasons(factory, dev)[2:] == ["QuarantineLifted", "Uncordoned"]
    with factory() as session:
        lifted = session.scalars(select(Event).where(Event.reason == "QuarantineLifted")).one()
    assert (lifted.message, lifted.data, utc(lifted.ts)) == (
        "quarantine lifted by alice (it was: wrong result at step 4)",
        {"by": "alice", "was": "wrong result at step 4"}, later)


def test_lifting_a_quarantine_alone_counts_as_a_change(factory) -> None:
    dev = add_device(factory, "a", NOW)
    with transaction(factory) as session:
        lifecycle.quarantine(session, dev, "wrong", NOW)
        session.get(Device, dev).cordoned = False  # an uncordon before lifts were recorded
        session.get(Device, dev).state = "Ready"
    with transaction(factory) as session:
        device, changed = lifecycle.uncordon(session, dev, NOW)
        assert changed and device.quarantine_reason is None
    with factory() as session:
        lifted = session.scalars(select(Event).where(Event.reason == "QuarantineLifted")).one()
    assert lifted.message == "quarantine lifted by an admin (it was: wrong)"
    with transaction(factory) as session:
        assert lifecycle.uncordon(session, dev, NOW)[1] is False  # nothing left to lift


def test_a_job_write_records_its_event_whole_and_none_without_one(factory) -> None:
    with transaction(factory) as session:
        job = Job(name="j", spec={}, state="Pending")
        session.add(job)
        session.flush()
        job_id = job.id
        started = JobEvent("Started", "placed on 2 devices", "Normal", {"devices": 2})
        assert transition(session, job_id, JobState.RUNNING, started, now=NOW)
        warned = JobEvent("Slow", "step 3 waits", "Warning", {"step": 3})
        assert update_job(session, job_id, expect={"state": "Running"}, event=warned, now=NOW,
                          reason="slow")
        assert update_job(session, job_id, expect={}, now=NOW, reason="quiet")  # no event
    with factory() as session:
        shown = [(e.reason, e.message, e.kind, e.data, utc(e.ts)) for e in session.scalars(
            select(Event).where(Event.job_id == job_id).order_by(Event.id))]
        assert session.get(Job, job_id).reason == "quiet"
    assert shown == [("Started", "placed on 2 devices", "Normal", {"devices": 2}, NOW),
                     ("Slow", "step 3 waits", "Warning", {"step": 3}, NOW)]


def test_a_quarantine_names_the_job_whose_audit_found_it(factory) -> None:
    dev = add_device(factory, "a", NOW)
    with transaction(factory) as session:
        job = Job(name="j", spec={})
        session.add(job)
        session.flush()
        job_id = job.id
        assert lifecycle.quarantine(session, dev, "wrong", NOW, job_id=job_id)
    with factory() as session:
        event = session.scalars(select(Event).where(Event.reason == "Quarantined")).one()
    assert event.job_id == job_id
