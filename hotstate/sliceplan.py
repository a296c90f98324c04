"""A sliced step's plan in the hot state (scheduler.apply.plan_step writes it, the API reads it to
serve a slice of the next step's weights as soon as it is applied)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from engine.tree import Node
from hotstate import keys
from hotstate.blobs import BlobStore


@dataclass(frozen=True)
class SlicePlan:
    nonce: str  # what state t+1's slices are stored under
    cover: tuple[Node, ...]  # the results every slice adds
    # what the step's audits found (scheduler.audits), recorded with the commit: the devices
    # whose every result was audited and agreed, and those with a result applied unchecked
    agreed: tuple[str, ...] = ()
    unaudited: tuple[str, ...] = ()

    def encode(self) -> bytes:
        out = {"nonce": self.nonce, "cover": [list(n) for n in self.cover]}
        if self.agreed or self.unaudited:
            out.update(agreed=list(self.agreed), unaudited=list(self.unaudited))
        return json.dumps(out).encode()

    @classmethod
    def decode(cls, data: bytes | None) -> SlicePlan | None:
        if data is None:
            return None
        try:
            raw = json.loads(data)
            return cls(str(raw["nonce"]), tuple((int(lo), int(hi)) for lo, hi in raw["cover"]),
                       tuple(str(d) for d in raw.get("agreed", ())),
                       tuple(str(d) for d in raw.get("unaudited", ())))
        except (ValueError, KeyError, TypeError):
            return None


def read_plan(blobs: BlobStore, job_id: str, step: int, nonce: str | None) -> SlicePlan | None:
    """The plan of applying `step` to the state named `nonce`, if one was made."""
    return SlicePlan.decode(blobs.get(keys.slice_plan(job_id, step, nonce)))
