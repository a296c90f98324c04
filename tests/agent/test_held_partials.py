"""A phone whose shards take longer than one request still uploads one partial per node of its
share: the compute worker holds what it pre-added between requests (agent.runtime.worker)."""

from __future__ import annotations

import numpy as np

from agent.runtime.worker import Computed, HeldPartials
from engine.spec import TrainSpec
from engine.step import ShardResult, pre_reduce
from wire.messages import decode_results

SPEC = TrainSpec.from_job_spec({"model": {"arch": "mlp"}, "dataset": "digits", "shards": 16,
                                "global_batch_size": 64, "seed": 0}, n_train=1000)


def leaf(k: int) -> ShardResult:
    rng = np.random.default_rng(k)
    return ShardResult(k, (rng.standard_normal(3000) * 10.0 ** rng.integers(-4, 4, 3000))
                       .astype(np.float32), 1.5 * k, k % 3, SPEC.per_shard_batch,
                       rng.standard_normal(4).astype(np.float32))


def ask(held: HeldPartials, shards: list[int], share: list[int], last: bool,
        step: int = 7) -> list[ShardResult] | None:
    done = Computed.of([leaf(k) for k in shards], "float32")
    req = {"job_id": "j", "step": step, "shards": {str(k): "" for k in shards},
           "step_shards": share, "last": last}
    out = held.add(done, req, SPEC)
    return None if out is None else decode_results(b"".join(out.parts("j", step)))


def same(a: list[ShardResult], b: list[ShardResult]) -> bool:
    return [(r.node, r.grad_sum.tobytes(), r.stats.tobytes(), r.loss_sum, r.correct, r.count)
            for r in a] == [(r.node, r.grad_sum.tobytes(), r.stats.tobytes(), r.loss_sum,
                             r.correct, r.count) for r in b]


def test_one_shard_a_request_still_goes_up_as_one_partial_bit_for_bit() -> None:
    held, share = HeldPartials(), list(range(8, 16))
    for k in range(8, 15):
        assert ask(held, [k], share, last=False) is None  # held: its node [8,16) is not full
    [partial] = ask(held, [15], share, last=True)
    assert partial.node == (8, 16)
    assert same([partial], pre_reduce([leaf(k) for k in share], 16, "float32"))


def test_each_node_of_the_share_goes_up_as_soon_as_it_is_filled() -> None:
    """Shards 3..9 of 16 are nodes [3,4) [4,8) [8,10): each leaves the phone once filled."""
    held, share = HeldPartials(), list(range(3, 10))
    assert same(ask(held, [3], share, last=False), [leaf(3)])
    assert ask(held, [4, 5], share, last=False) is None
    [four] = ask(held, [6, 7], share, last=False)
    assert four.node == (4, 8)
    assert same([four], pre_reduce([leaf(k) for k in range(4, 8)], 16, "float32"))
    [eight] = ask(held, [8, 9], share, last=True)
    assert eight.node == (8, 10)


def test_a_new_pass_drops_what_was_held_and_the_last_request_sends_the_rest() -> None:
    """Paused mid-step, the agent polls again and sets out on what the server lists: what the
    worker held from the first pass is computed again, never added twice."""
    held = HeldPartials()
    assert ask(held, [0, 1], list(range(8)), last=False) is None
    again = ask(held, [0, 1, 2, 3], list(range(4)), last=True)  # a new share: afresh
    assert same(again, pre_reduce([leaf(k) for k in range(4)], 16, "float32"))
    assert ask(held, [8], list(range(8, 16)), last=False) is None
    rest = ask(held, [9], list(range(8, 16)), last=True)  # cut short: what it has, as nodes
    assert [r.node for r in rest] == [(8, 10)]
    assert ask(held, [8], list(range(8, 16)), last=False, step=8) is None
    assert same(ask(held, [9], list(range(8, 16)), last=True, step=9), [leaf(9)])  # not step 8's


def test_shards_computed_again_with_the_same_share_are_not_added_twice() -> None:
    """Paused mid-pass, the agent polls again and the server lists the same shards (nothing of
    them was uploaded): what the worker held merges by tree node with the recomputed leaves."""
    held, share = HeldPartials(), list(range(8, 16))
    assert ask(held, [8, 9], share, last=False) is None
    for chunk in ([8, 9], [10, 11]):  # the second pass recomputes 8 and 9
        assert ask(held, chunk, share, last=False) is None
    [partial] = ask(held, [12, 13, 14, 15], share, last=True)
    assert same([partial], pre_reduce([leaf(k) for k in share], 16, "float32"))
    assert partial.count == 8 * SPEC.per_shard_batch
