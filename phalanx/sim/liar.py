"""Phones that lie, to test audits with (issue 41; docs/scheduler.md, "Audits").

A liar computes its shards honestly, then corrupts what it uploads: `flip` changes one float of
a result's gradient, `stale` returns the gradient (and statistics) it computed for the same
shards at its previous step. It lies on every `every`-th result it uploads from step
`from_step` on (honest before: a liar that waits out its probation). The message it sends is
well formed (its checksum, sizes and finite values right): only an audit can tell.

- `phalanx sim --compute --liars N`: the fleet's first N light phones lie (phalanx.sim.compute
  passes their results through `Liar.tamper` between computing and uploading);
- `phalanx demo --liars N`, `tests/e2e`: a phone runs the real agent through this module,
  `python -m phalanx.sim.liar --lie flip:1:0 run --config ...`: the agent unchanged, its
  client's upload passing the encoded results through `Liar.tamper_body` first.
"""

from __future__ import annotations

import argparse
import logging
import sys
import threading
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from agent.cli import main as agent_main
from agent.client import Client
from engine.step import ShardResult
from wire.messages import WireError, decode_results, encode_results

MODES = ("flip", "stale")
DTYPES = ("float32", "bfloat16", "float16")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Lie:
    mode: str = "flip"
    every: int = 1  # lie on every k-th result uploaded
    from_step: int = 0  # honest before this step

    @classmethod
    def parse(cls, text: str) -> Lie:
        """`MODE[:EVERY[:FROM_STEP]]`, e.g. `flip`, `flip:3`, `stale:1:20`."""
        mode, *rest = text.split(":")
        try:
            every = int(rest[0]) if rest else 1
            from_step = int(rest[1]) if len(rest) > 1 else 0
        except ValueError:
            raise ValueError(f"a lie is MODE[:EVERY[:FROM_STEP]], got {text!r}") from None
        if mode not in MODES or every < 1 or from_step < 0 or len(rest) > 2:
            raise ValueError(f"a lie is MODE[:EVERY[:FROM_STEP]] with MODE one of "
                             f"{', '.join(MODES)}, EVERY >= 1, FROM_STEP >= 0; got {text!r}")
        return cls(mode, every, from_step)

    def __str__(self) -> str:
        return f"{self.mode}:{self.every}:{self.from_step}"


class Liar:
    """One phone's lies: which of its results it corrupts, and how."""

    def __init__(self, lie: Lie) -> None:
        self.lie = lie
        self.results = 0  # results seen from `from_step` on
        self.lies = 0
        self._previous: dict[tuple[int, int], tuple[int, ShardResult]] = {}
        self._lock = threading.Lock()

    def tamper(self, step: int, results: list[ShardResult]) -> list[ShardResult]:
        """`results` as this liar uploads them (a new list; the honest ones untouched)."""
        with self._lock:
            return [self._one(step, r) for r in results]

    def _one(self, step: int, honest: ShardResult) -> ShardResult:
        before = self._previous.get(honest.node)
        if before is None or before[0] < step:
            self._previous[honest.node] = (step, _copy(honest))
        if step < self.lie.from_step:
            return honest
        self.results += 1
        if self.results % self.lie.every:
            return honest
        self.lies += 1
        if self.lie.mode == "stale" and before is not None and before[0] < step:
            old = before[1]
            return replace(honest, grad_sum=old.grad_sum.copy(), stats=old.stats.copy())
        grad = np.array(honest.grad_sum, dtype=np.float32, copy=True)
        at = (step * 7919 + honest.shard) % max(1, grad.size)
        grad[at] = grad[at] + np.float32(max(1.0, 2 * abs(float(grad[at]))))  # one float
        return replace(honest, grad_sum=grad)

    def tamper_body(self, job_id: str, step: int,
                    body: bytes | bytearray | memoryview | list[Any]) -> bytes:
        """An encoded results message of `job_id`'s `step` with its results tampered, encoded
        again in its dtype."""
        data = b"".join(bytes(p) for p in body) if isinstance(body, list) else bytes(body)
        for dtype in DTYPES:
            try:
                results = decode_results(data, expect_job=job_id, expect_step=step,
                                         expect_dtype=dtype)
            except WireError:
                continue
            return encode_results(job_id, step, self.tamper(step, results), dtype)
        return data  # not a results message this liar understands: sent as it is


def _copy(r: ShardResult) -> ShardResult:
    return replace(r, grad_sum=np.array(r.grad_sum, copy=True), stats=np.array(r.stats, copy=True))


def patch_agent(lie: Lie) -> Liar:
    """Make this process's agent a liar: its client's gradient uploads go through the lie."""
    liar = Liar(lie)
    honest = Client.upload_gradients

    def upload_gradients(self: Client, job_id: str, step: int, body: Any,
                         bulk_url: str | None = None) -> dict[str, Any]:
        told = liar.tamper_body(job_id, step, body)
        if liar.lies:
            log.warning("liar (%s): %d of %d results corrupted so far", lie, liar.lies,
                        liar.results)
        return honest(self, job_id, step, told, bulk_url)

    Client.upload_gradients = upload_gradients  # type: ignore[method-assign]
    return liar


def main(argv: list[str] | None = None) -> int:
    """`python -m phalanx.sim.liar --lie MODE[:EVERY[:FROM_STEP]] AGENT-ARGS...`: the real
    agent (`python -m agent AGENT-ARGS...`), lying."""
    p = argparse.ArgumentParser(prog="python -m phalanx.sim.liar")
    p.add_argument("--lie", type=Lie.parse, default=Lie())
    args, rest = p.parse_known_args(argv)
    patch_agent(args.lie)
    return agent_main(rest)


if __name__ == "__main__":
    sys.exit(main())
