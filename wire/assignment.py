"""The work a device is given for one step (`GET /v1/devices/{id}/work`): one definition for the
server that builds it (api.steps.protocol; its OpenAPI schema comes from this class), the phone
agent and the simulator that read it. Stdlib only: it ships to phones."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any

from wire.messages import WireError


@dataclass(frozen=True)
class Assignment:
    job_id: str
    step: int
    shards: list[int]  # this device's shards of the step still to upload
    spec: dict[str, Any]  # the job's spec as submitted (model, optimizer, batch sizes, ...)
    n_params: int
    n_buffers: int
    n_stats: int
    total_steps: int
    n_train: int
    input_shape: list[int]
    num_classes: int
    bulk_url: str | None = field(default=None)  # weights and uploads there; else the API port
    # the server takes partials (engine.tree): the phone adds the shards it holds and uploads
    # one result per tree node they fill; absent (an older server): one result per shard
    pre_reduce: bool = field(default=False)
    # a sliced job (engine.slices): the [lo, hi) of each slice, fetched as its own weights
    # message; empty: one message. `state`: the name of the step's state (the nonce a weights
    # message's X-Phalanx-State carries), so slices fetched ahead are used only if they match
    slices: list[list[int]] = field(default_factory=list)
    state: str | None = field(default=None)

    @classmethod
    def from_json(cls, data: Any) -> Assignment:
        """From the decoded JSON answer; a field missing or of the wrong kind is a WireError
        naming it (an agent older or newer than the server learns what differs)."""
        if not isinstance(data, dict):
            raise WireError(f"assignment must be a JSON object, not {type(data).__name__}")
        values: dict[str, Any] = {}
        for f in fields(cls):
            if f.name not in data:
                if f.name in OPTIONAL:
                    continue
                raise WireError(f"assignment lacks {f.name!r}")
            values[f.name] = _checked(f.name, data[f.name])
        return cls(**values)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


OPTIONAL = ("bulk_url", "pre_reduce", "slices", "state")  # absent from older servers
_INTS = {"step", "n_params", "n_buffers", "n_stats", "total_steps", "n_train", "num_classes"}


def _checked(name: str, value: Any) -> Any:
    def bad(kind: str) -> WireError:
        return WireError(f"assignment field {name!r} must be {kind}, got {value!r:.80}")

    if name in _INTS:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad("an integer")
        return value
    if name in ("shards", "input_shape"):
        if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int)
                                              for v in value):
            raise bad("a list of integers")
        return list(value)
    if name == "spec":
        if not isinstance(value, dict):
            raise bad("an object")
        return value
    if name == "job_id":
        if not isinstance(value, str) or not value:
            raise bad("a non-empty string")
        return value
    if name == "slices":
        if not isinstance(value, list) or any(
                not isinstance(v, list) or len(v) != 2
                or any(isinstance(b, bool) or not isinstance(b, int) for b in v) for v in value):
            raise bad("a list of [lo, hi] integer pairs")
        return [list(v) for v in value]
    if name in ("bulk_url", "state"):
        if value is not None and not isinstance(value, str):
            raise bad("a string or null")
        return value
    if name == "pre_reduce":
        if not isinstance(value, bool):
            raise bad("a boolean")
        return value
    return value
