"""The audit policy (scheduler/policy/audit.py), without servers: the draw, probation, who
audits, who wins, where a job rewinds, and the documented catch formula checked against the
draw itself over many audit keys (docs/scheduler.md, "Audits")."""

from __future__ import annotations

import statistics

import pytest

from engine import tree
from scheduler.policy.audit import (
    Verdict,
    chosen_inside,
    drawn,
    judge,
    least_loaded,
    needs_audit,
    on_probation,
    p_uncaught,
    plan_audits,
    rewind_target,
    steps_to_catch,
)

KEYS = [f"key-{i}" for i in range(3000)]


def test_the_draw_is_a_pure_function_of_key_step_and_node() -> None:
    assert [drawn("k", 7, (4, 8), 0.3) for _ in range(3)] == [drawn("k", 7, (4, 8), 0.3)] * 3
    # another key (another job), another step or another node: other draws
    picks = {(key, step, node): drawn(key, step, node, 0.5) for key in ("a", "b")
             for step in range(20) for node in ((0, 4), (4, 8))}
    assert len(set(picks.values())) == 2


@pytest.mark.parametrize("rate", [0.02, 0.1, 0.5])
def test_a_node_is_drawn_with_the_audit_rate(rate: float) -> None:
    hits = sum(drawn(key, step, (0, 4), rate) for key in KEYS[:1000] for step in range(20))
    assert hits / 20000 == pytest.approx(rate, abs=4 * (rate * (1 - rate) / 20000) ** 0.5)


def test_rate_zero_audits_nothing_and_rate_one_everything() -> None:
    assert not any(drawn(key, 3, (0, 1), 0.0) for key in KEYS[:200])
    assert all(drawn(key, 3, (0, 1), 1.0) for key in KEYS[:200])


def test_the_job_seed_does_not_tell_a_phone_which_nodes_are_audited() -> None:
    # the draw's only secret is the audit key: the phone reads the seed in its assignment
    assert [drawn("0", t, (0, 4), 0.5) for t in range(40)] != \
        [drawn("server-secret", t, (0, 4), 0.5) for t in range(40)]


@pytest.mark.parametrize("rate,nodes", [(0.02, 4), (0.1, 2), (0.3, 1)])
def test_the_catch_formula_holds_over_many_keys(rate: float, nodes: int) -> None:
    """A liar lying on every one of its n upload nodes each step, past its probation: over
    3000 audit keys (jobs), the share still uncaught after T steps is (1 - r)^(n T), and the
    lied nodes up to and including the one caught average 1/r."""
    node_list = [(4 * i, 4 * i + 4) for i in range(nodes)]
    caught_at, lies = [], []
    for key in KEYS:
        step, lied = 0, 0
        while True:
            hits = [drawn(key, step, node, rate) for node in node_list]
            if any(hits):
                caught_at.append(step + 1)  # steps it lied in, this one included
                lies.append(lied + hits.index(True) + 1)
                break
            lied += nodes
            step += 1
    n = len(KEYS)
    for steps in (1, 2, 5, 10, 20):
        uncaught = sum(c > steps for c in caught_at) / n
        expected = p_uncaught(rate, nodes, steps)
        assert uncaught == pytest.approx(expected, abs=4 * (expected * (1 - expected) / n) ** 0.5
                                         + 1e-9), steps
    sd = ((1 - rate) / rate ** 2 / n) ** 0.5  # the geometric distribution's, of the mean
    assert statistics.mean(lies) == pytest.approx(1 / rate, abs=4 * sd)
    t99 = steps_to_catch(rate, nodes, 0.99)
    assert p_uncaught(rate, nodes, t99) <= 0.01 < p_uncaught(rate, nodes, t99 - 1)
    assert sum(c <= t99 for c in caught_at) / n >= 0.98


def test_steps_to_catch_at_the_edges() -> None:
    assert steps_to_catch(1.0, 1) == 1
    assert steps_to_catch(0.5, 1, 0.5) == 1
    assert steps_to_catch(0.02, 8, 0.99) == 29  # 0.98^(8 x 29) = 0.0092, 0.98^(8 x 28) = 0.0108
    with pytest.raises(ValueError):
        steps_to_catch(0.0, 4)


def test_probation_audits_every_node_of_a_new_device_from_its_first_step() -> None:
    primaries = {k: "liar" if k < 6 else "honest" for k in range(16)}
    plan = plan_audits(primaries, 16, "key", 0, rate=0.0, probation={"liar"})
    assert set(plan) == set(tree.cover(range(6), 16)) == {(0, 4), (4, 6)}
    assert {holder for holder, _ in plan.values()} == {"liar"}
    assert {auditor for _, auditor in plan.values()} == {"honest"}


@pytest.mark.parametrize("verified,expected", [
    ({}, {"a", "b"}),  # never audited: both on probation
    ({"a": 20, "b": 19}, {"b"}),  # a served its 20 steps
    ({"a": 25, "b": 20}, set()),
])
def test_a_device_is_on_probation_until_its_steps_were_audited(
        verified: dict[str, int], expected: set[str]) -> None:
    assert on_probation(verified, ["a", "b"], 20) == expected


def test_no_probation_when_probation_steps_is_zero() -> None:
    assert on_probation({}, ["a", "b"], 0) == frozenset()


def test_a_result_of_unknown_uploader_needs_no_audit() -> None:
    assert not needs_audit("k", 0, (0, 1), 1.0, None, {"a"})
    assert needs_audit("k", 0, (0, 1), 0.0, "a", {"a"})


def test_audits_go_to_another_device_and_spread_by_load() -> None:
    primaries = {k: f"d{k // 4}" for k in range(16)}  # four devices, one node of 4 each
    plan = plan_audits(primaries, 16, "key", 5, rate=1.0, probation=())
    assert sorted(plan) == [(0, 4), (4, 8), (8, 12), (12, 16)]
    for (lo, _), (holder, auditor) in plan.items():
        assert holder == f"d{lo // 4}" and auditor != holder
    assert sorted(a for _, a in plan.values()) == ["d0", "d1", "d2", "d3"]  # one each


def test_a_faster_device_takes_more_audits() -> None:
    primaries = {k: f"d{k // 4}" for k in range(16)}
    plan = plan_audits(primaries, 16, "key", 5, rate=1.0, probation=(),
                       speeds={"d0": 100.0, "d1": 1.0, "d2": 1.0, "d3": 1.0})
    assert sum(a == "d0" for _, a in plan.values()) == 3  # all but its own node


def test_a_job_of_one_device_has_nobody_to_audit_it() -> None:
    assert plan_audits({k: "only" for k in range(8)}, 8, "key", 0, 1.0, {"only"}) == {}


@pytest.mark.parametrize("audited,chosen,expected", [
    ((4, 8), [(0, 4), (4, 8), (8, 16)], [(4, 8)]),  # uploaded as audited
    ((4, 8), [(0, 4), (4, 6), (6, 8), (8, 16)], [(4, 6), (6, 8)]),  # uploaded in two parts
    ((4, 8), [(0, 8), (8, 16)], None),  # a larger node was uploaded: no comparison
])
def test_what_an_audit_is_compared_with(audited: tuple[int, int], chosen: list,
                                        expected: list | None) -> None:
    assert chosen_inside(audited, chosen) == expected


@pytest.mark.parametrize("holder,auditor,decider,verdict", [
    (b"x", b"x", None, Verdict.AGREE),
    (b"x", b"y", None, Verdict.DECIDE),
    (b"x", b"y", b"y", Verdict.HOLDER_LOST),
    (b"x", b"y", b"x", Verdict.AUDITOR_LOST),
    (b"x", b"y", b"z", Verdict.NO_MAJORITY),
])
def test_two_of_three_decide(holder: bytes, auditor: bytes, decider: bytes | None,
                             verdict: Verdict) -> None:
    assert judge(holder, auditor, decider) is verdict


@pytest.mark.parametrize("first,checkpoints,target", [
    (None, [5, 10], None),  # every result of the liar was audited: no rewind
    (7, [5, 10], 5),  # the newest checkpoint before its first unaudited result
    (10, [5, 10], 10),  # state 10 holds the results of steps < 10: clean
    (3, [5, 10], 0),  # none that old: step 0's seeded initial state
])
def test_where_a_job_rewinds(first: int | None, checkpoints: list[int],
                             target: int | None) -> None:
    assert rewind_target(first, checkpoints) == target


# -- the second mutation run's survivors (docs/testing.md) -------------------------------------

def test_one_probation_step_still_puts_a_new_device_on_probation() -> None:
    assert on_probation({}, ["new"], 1) == {"new"}
    assert on_probation({"old": 1}, ["old"], 1) == frozenset()


def test_at_a_fractional_rate_exactly_the_drawn_nodes_are_audited() -> None:
    # each holder uploads several nodes (its shards are not contiguous): every one is judged
    primaries = {k: ("a", "b", "c")[k % 3] for k in range(24)}
    covers = {d: tree.cover([k for k, h in primaries.items() if h == d], 24) for d in "abc"}
    assert all(len(nodes) > 3 for nodes in covers.values())
    for step in range(6):
        plan = plan_audits(primaries, 24, "job-key", step, 0.4, probation=())
        want = {node for nodes in covers.values() for node in nodes
                if drawn("job-key", step, node, 0.4)}
        assert set(plan) == want and 0 < len(want) < sum(map(len, covers.values()))
        assert all(needs_audit("job-key", step, n, 0.4, "a", ()) == drawn("job-key", step, n, 0.4)
                   for n in covers["a"])


@pytest.mark.parametrize("speeds,most", [
    ({"d0": 0.5, "d1": 0.05, "d2": 0.05, "d3": 0.05}, "d0"),  # speeds below 1 still count
    ({"d2": 5.0}, "d2"),  # a device without a measured speed counts as 1 (not 2: then 2)
])
def test_the_fastest_relative_to_the_others_takes_the_most_audits(speeds, most) -> None:
    primaries = {k: f"d{k // 4}" for k in range(16)}
    plan = plan_audits(primaries, 16, "key", 5, rate=1.0, probation=(), speeds=speeds)
    taken = {d: sum(a == d for _, a in plan.values()) for d in ("d0", "d1", "d2", "d3")}
    assert taken[most] == 3 and sum(taken.values()) == 4, taken


def test_an_auditor_s_load_grows_by_the_size_of_the_node_it_took() -> None:
    """a holds 0..7 (one node of 8), b 8..11 and c 12..15 (nodes of 4); everyone audited.
    a's node goes to b (4 < 8 shards of work; c ties, b is first): b has 12. b's to c (4):
    c has 8. c's to a (8 < 12). With b at half speed, a's node goes to c (b's 4 shards weigh
    8), and so on from loads grown by each node's size."""
    primaries = {k: "a" if k < 8 else "b" if k < 12 else "c" for k in range(16)}
    plan = plan_audits(primaries, 16, "key", 0, rate=1.0, probation=())
    assert plan == {(0, 8): ("a", "b"), (8, 12): ("b", "c"), (12, 16): ("c", "a")}
    slow_b = plan_audits(primaries, 16, "key", 0, rate=1.0, probation=(),
                         speeds={"a": 1.0, "b": 0.5, "c": 1.0})
    assert slow_b[(0, 8)] == ("a", "c")  # b's 4 shards take it as long as 8 elsewhere


@pytest.mark.parametrize("order,work,speed,expected", [
    (["b", "a"], {"b": 1.0}, {}, "a"),  # no audits yet counts as no work
    (["a", "b"], {"a": 1.0, "b": 1.0}, {"b": 1.5}, "b"),  # no speed counts as 1
    (["a", "b"], {"a": 2.0, "b": 2.0}, {}, "a"),  # ties: the first
    ([], {}, {}, None),
])
def test_the_least_loaded_by_work_per_speed(order, work, speed, expected) -> None:
    assert least_loaded(order, work, speed) == expected


def test_a_larger_node_starting_where_the_audited_one_starts_cannot_be_compared() -> None:
    assert chosen_inside((4, 6), [(0, 4), (4, 8), (8, 16)]) is None
    assert chosen_inside((4, 8), [(0, 4), (4, 12), (12, 16)]) is None


def test_the_draw_is_the_documented_keyed_blake2b_of_step_and_node() -> None:
    """docs/scheduler.md: BLAKE2b-64 of "step:lo:hi" keyed by the job's audit key (its first 64
    bytes), read big-endian as a fraction of 2^64, audited below the rate: every replica and
    worker, of any version, draws the same nodes."""
    import hashlib

    for key in ("job-key", "k" * 100):  # a key past BLAKE2b's 64 bytes is cut, not refused
        for step, node in ((0, (0, 1)), (7, (4, 8)), (123, (8, 16))):
            mac = hashlib.blake2b(f"{step}:{node[0]}:{node[1]}".encode(), digest_size=8,
                                  key=key.encode()[:64]).digest()
            u = int.from_bytes(mac, "big") / 2.0 ** 64
            for rate in (0.1, 0.5, 0.9):
                assert drawn(key, step, node, rate) == (u < rate)


def test_steps_to_catch_is_the_least_t_by_its_definition() -> None:
    """The least T with (1 - r)^(n T) <= 1 - confidence, searched one step at a time."""
    for rate in (0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 0.7, 0.9):
        for n in (1, 2, 3, 8, 40):
            for confidence in (0.5, 0.75, 0.9, 0.99, 0.999):
                t = 1
                while p_uncaught(rate, n, t) > 1.0 - confidence:
                    t += 1
                assert steps_to_catch(rate, n, confidence) == t, (rate, n, confidence)
    assert steps_to_catch(0.02, 8) == steps_to_catch(0.02, 8, 0.99)  # 99% unless told
    with pytest.raises(ValueError) as never:
        steps_to_catch(0.0, 4)
    assert str(never.value) == "a liar is never audited at rate 0 without probation"
