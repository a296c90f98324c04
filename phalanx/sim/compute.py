"""`phalanx sim --compute`: light phones that take real work over the step protocol.

Each phone long-polls `GET /v1/devices/{id}/work`, fetches the step's weights and its shards'
data, computes the gradient sums with the engine (`engine`, the same functions the agent's
compute worker calls), sleeps for the extra time its profile's speed asks for, and uploads the
result (docs/contracts.md, "Step protocol"). The fleet shares decoded weights, shard arrays and
built models between phones: bytes still cross the wire once per phone, but decoding and model
building happen once per (job, step).
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from engine.runner import JobModel, job_model, shard_arrays, shard_gradient
from wire.assignment import Assignment
from wire.messages import WireError, decode_weights, encode_results

if TYPE_CHECKING:  # the fleet calls take_work; a phone is only its argument here
    from phalanx.sim.fleet import LightPhone

WAIT_S = 10


class SharedEngine:
    """Per-job model and spec, per-step weights, per-shard arrays, for every phone."""

    def __init__(self) -> None:
        self.models: dict[str, JobModel] = {}
        self.weights: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = {}
        self.shards: dict[tuple[str, int], tuple[np.ndarray, np.ndarray]] = {}

    def model(self, a: Assignment) -> JobModel:
        key = json.dumps([a.job_id, a.spec], sort_keys=True)
        if key not in self.models:
            self.models[key] = job_model(a.spec, a.n_train, a.input_shape, a.num_classes)
        return self.models[key]

    def weights_of(self, job: str, step: int, data: bytes) -> tuple[np.ndarray, np.ndarray]:
        if (job, step) not in self.weights:
            for old in [k for k in self.weights if k[0] == job and k[1] < step]:
                del self.weights[old]
            _, params, buffers = decode_weights(data, expect_job=job, expect_step=step)
            self.weights[(job, step)] = (params, buffers)
        return self.weights[(job, step)]


ENGINE = SharedEngine()


def _compute(job: JobModel, params: np.ndarray, buffers: np.ndarray,
             data: dict[int, tuple[np.ndarray, np.ndarray]], step: int) -> list[Any]:
    return [shard_gradient(job, params, buffers, x, y, step, k)
            for k, (x, y) in sorted(data.items())]


async def _get(phone: LightPhone, endpoint: str, path: str, **kwargs: Any) -> Any:
    headers = {"Authorization": f"Bearer {phone.token}"}
    return await phone.call(endpoint, "GET", path, headers=headers, **kwargs)


async def _shard(phone: LightPhone, job: str, k: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Shard k's samples, asked for in chunks as the agent asks (the server answers a shard
    bigger than a chunk only so); decoded once for the fleet. None when this phone does not
    hold it (any more)."""
    parts: list[tuple[np.ndarray, np.ndarray]] = []
    start, total = 0, None
    while total is None or start < total:
        got = await _get(phone, "shard_data", f"/v1/jobs/{job}/shards/{k}/data",
                         params={"start": start}, expected=(403,))
        if got.status_code != 200:
            return None
        total = int(got.headers["X-Phalanx-Shard-Samples"])
        if not parts and (job, k) in ENGINE.shards:
            return ENGINE.shards[(job, k)]
        x, y = shard_arrays(got.content)
        if not len(y) and start < total:
            raise WireError(f"shard {k} of {job}: an empty chunk at {start} of {total}")
        parts.append((x, y))
        start += len(y)
    if len(parts) == 1:
        ENGINE.shards[(job, k)] = parts[0]
    else:
        ENGINE.shards[(job, k)] = (np.concatenate([p[0] for p in parts]),
                                   np.concatenate([p[1] for p in parts]))
    return ENGINE.shards[(job, k)]


async def one_step(phone: LightPhone, a: Assignment) -> bool:
    """Compute and upload this phone's shards of the assignment; False when it moved on."""
    job, step, shards = a.job_id, a.step, a.shards
    built = ENGINE.model(a)
    resp = await _get(phone, "weights", f"/v1/jobs/{job}/weights", params={"step": step},
                      expected=(409,))
    if resp.status_code == 409:
        return False
    params, buffers = ENGINE.weights_of(job, step, resp.content)
    data = {}
    for k in shards:
        shard = await _shard(phone, job, k)
        if shard is None:
            return False
        data[k] = shard
    started = time.perf_counter()
    results = await asyncio.to_thread(_compute, built, params, buffers, data, step)
    compute_s = time.perf_counter() - started
    if phone.liar is not None:  # computed honestly, then corrupted before the upload
        results = phone.liar.tamper(step, results)
    await phone.fleet.sleep((phone.model.slowdown - 1.0) * compute_s)
    samples = sum(int(r.count) for r in results)
    phone.profiles[built.spec.arch] = {"samples_per_s": round(samples / (compute_s * phone.model.slowdown
                                                                    + 1e-9), 1),
                                 "threads": 1, "backend": "numpy"}
    body = encode_results(job, step, results, dtype=built.spec.upload_precision)
    headers = {"Authorization": f"Bearer {phone.token}",
               "Content-Type": "application/octet-stream"}
    up = await phone.call("gradients", "POST", f"/v1/jobs/{job}/steps/{step}/gradients",
                          content=body, headers=headers, expected=(403, 409))
    phone.computed_shards += len(shards) if up.status_code == 200 else 0
    return up.status_code == 200


async def take_work(phone: LightPhone) -> None:
    """The phone's work loop, beside its heartbeat loop, until the fleet stops."""
    while phone.device_id is None and not phone.fleet.stopping.is_set():
        await phone.fleet.sleep(0.2)
    while not phone.fleet.stopping.is_set():
        resp = await _get(phone, "work", f"/v1/devices/{phone.device_id}/work",
                          params={"wait": WAIT_S}, timeout=WAIT_S + 20)
        if resp.status_code != 200:
            await phone.fleet.sleep(phone.backoff.next_delay())
            continue
        found = resp.json().get("assignment")
        if not found or not found.get("shards"):
            phone.load = 0.05
            continue
        phone.load = 1.0
        try:
            if not await one_step(phone, Assignment.from_json(found)):
                await phone.fleet.sleep(0.2)
        except (WireError, ValueError, KeyError) as exc:
            phone.fleet.stats.errors[f"compute: {type(exc).__name__}: {exc}"[:160]] += 1
            await phone.fleet.sleep(phone.backoff.next_delay())


__all__ = ["take_work", "one_step", "SharedEngine"]
