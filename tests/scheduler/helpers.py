"""Factories for scheduler tests: a context on a real database, devices, jobs, real results."""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient
from sqlalchemy import select

from agent.runtime.agent import FEATURES, compute_class
from api.steps.protocol import store_results
from domain.settings import Settings
from domain.store.db import make_engine, make_session_factory, transaction
from domain.store.models import Device, Event, Job, ShardAssignment
from engine.data import load_dataset
from engine.jobinfo import job_info
from engine.runner import shard_gradient
from engine.sampler import shard_indices
from hotstate import keys
from hotstate.blobs import BlobStore, MemoryBlobStore, RedisBlobStore
from scheduler import context
from scheduler.context import SchedulerContext, Tuning
from scheduler.tasks.reconcile import run_reconcile, run_reconcile_job
from scheduler.tasks.recovery import load_state
from scheduler.tasks.steps import run_apply_step
from tests.support.env import ADMIN_TOKEN
from wire.messages import decode_results, encode_results

NOW = dt.datetime(2026, 12, 2, 12, 0, tzinfo=dt.timezone.utc)
TINY = "synthetic:1x4x4:3:64"  # 64 samples of 1x4x4, 3 classes: steps take milliseconds


def capabilities() -> dict[str, Any]:
    """What an agent of today on this machine reports: every feature a job may ask for
    (upload_precision, portable, ...) and this machine's compute class (class jobs)."""
    return {"features": list(FEATURES), "compute_class": compute_class()}


class Clock:
    def __init__(self, now: dt.datetime = NOW) -> None:
        self.now = now

    def __call__(self) -> dt.datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += dt.timedelta(seconds=seconds)


def tiny_spec(**over: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "name": "tiny", "model": {"arch": "mlp", "hidden": 8}, "dataset": TINY,
        "global_batch_size": 16, "shards": 4, "epochs": 2, "seed": 3, "checkpoint_every": 3,
        "optimizer": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.0001, "schedule": "cosine"},
        "placement": {"min_devices": 1, "max_devices": 8}, "priority": 0,
        # no audits unless a test asks (tests/scheduler/test_audits.py): these drive the
        # protocol by hand, as phones that do not audit each other
        "verification": {"audit_rate": 0.0, "probation_steps": 0},
    }
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(spec.get(key), dict):
            spec[key] = {**spec[key], **value}
        else:
            spec[key] = value
    return spec


def make_ctx(db_url: str, tmp_path: Path, clock: Clock | None = None,
             blobs: BlobStore | None = None, **tuning: Any) -> SchedulerContext:
    """A scheduler context on `db_url`, with the hot state in `blobs` (default: in memory)."""
    settings = Settings(database_url=db_url, data_dir=tmp_path / "data")
    factory = make_session_factory(make_engine(db_url))
    return SchedulerContext(settings, factory, blobs or MemoryBlobStore(), clock or Clock(),
                            Tuning(**tuning))


def store_param_ctx(request: Any, db_url: str, tmp_path: Path, **tuning: Any) -> SchedulerContext:
    """A context on the blob store a test is parametrized with ("memory" or "redis")."""
    blobs = (RedisBlobStore(request.getfixturevalue("redis_url"))
             if request.param == "redis" else MemoryBlobStore())
    return make_ctx(db_url, tmp_path, blobs=blobs, **tuning)


def start_job(ctx: SchedulerContext, spec: dict[str, Any] | None = None, devices: int = 2) -> str:
    """A job placed on `devices` new devices, its step 0 state written."""
    add_devices(ctx, devices)
    job_id = submit(ctx, spec or tiny_spec())
    run_reconcile(ctx)
    assert run_reconcile_job(ctx, job_id) == "ok"  # writes step 0's seeded state
    return job_id


def run_to(ctx: SchedulerContext, job_id: str, step: int) -> None:
    """Every shard uploaded and the step applied, until the job is at `step`."""
    while job(ctx, job_id).step < step:
        t = job(ctx, job_id).step
        upload_all(ctx, job_id, t)
        assert run_apply_step(ctx, job_id, t) == "applied"


def add_devices(ctx: SchedulerContext, n: int, prefix: str = "dev", **fields: Any) -> list[str]:
    """Ready devices whose agents compute every feature this agent does (unless `fields` say)."""
    ids = [f"{prefix}-{i:02d}" for i in range(n)]
    fields.setdefault("capabilities", capabilities())
    with transaction(ctx.session_factory) as s:
        for device_id in ids:
            s.add(Device(id=device_id, name=device_id, state="Ready",
                         lease_renewed_at=ctx.clock(), profiles={"mlp": {"samples_per_s": 100.0}},
                         latest_telemetry={"battery_pct": 90, "charging": True, "cpu_temp_c": 30},
                         **fields))
    return ids


def submit(ctx: SchedulerContext, spec: dict[str, Any], owner: str | None = None) -> str:
    info = job_info("probe", spec, ctx.settings.data_dir)
    with transaction(ctx.session_factory) as s:
        job = Job(name=spec["name"], spec=spec, state="Pending", priority=spec.get("priority", 0),
                  total_steps=info.total_steps, owner=owner)
        s.add(job)
        s.flush()
        return job.id


def job(ctx: SchedulerContext, job_id: str) -> Job:
    with ctx.session_factory() as s:
        row = s.get(Job, job_id)
        assert row is not None
        s.expunge(row)
        return row


def assignments(ctx: SchedulerContext, job_id: str) -> list[tuple[int, str, str]]:
    with ctx.session_factory() as s:
        rows = s.scalars(select(ShardAssignment).where(ShardAssignment.job_id == job_id))
        return sorted((a.shard, a.device_id, a.role) for a in rows)


def event_reasons(ctx: SchedulerContext, job_id: str) -> list[str]:
    with ctx.session_factory() as s:
        return [e.reason for e in s.scalars(select(Event).where(Event.job_id == job_id)
                                            .order_by(Event.id))]


def set_device(ctx: SchedulerContext, device_id: str, **values: Any) -> None:
    with transaction(ctx.session_factory) as s:
        device = s.get(Device, device_id)
        for key, value in values.items():
            setattr(device, key, value)


def shard_result_blobs(ctx: SchedulerContext, job_id: str, step: int) -> dict[int, bytes]:
    """Every shard's result for `step`, computed by the engine from the stored weights."""
    row = job(ctx, job_id)
    info = job_info(job_id, row.spec, ctx.settings.data_dir)
    state = load_state(ctx, job_id, step, row.state_nonce, info.slices)
    assert state is not None, f"no state for step {step}"
    data = load_dataset(info.spec.dataset)
    out = {}
    for k, idx in enumerate(shard_indices(info.n_train, info.spec.shards, info.spec.seed)):
        r = shard_gradient(info, state.params, state.buffers, data.x_train[idx],
                           data.y_train[idx], step, k)
        out[k] = encode_results(job_id, step, [r])
    return out


def state_key(ctx: SchedulerContext, job_id: str, step: int) -> str:
    """Where the state of `step` is stored, as the job's row names it."""
    return keys.state(job_id, step, job(ctx, job_id).state_nonce)


def stored_state(ctx: SchedulerContext, job_id: str, step: int) -> Any:
    row = job(ctx, job_id)
    info = job_info(job_id, row.spec, ctx.settings.data_dir)
    return load_state(ctx, job_id, step, row.state_nonce, info.slices)


def upload_all(ctx: SchedulerContext, job_id: str, step: int,
               shards: Iterable[int] | None = None, blobs: dict[int, bytes] | None = None) -> None:
    """Store each shard's result (every shard, or `shards`; from `blobs` when given, computed
    now otherwise) the way the gradient route does."""
    blobs = blobs if blobs is not None else shard_result_blobs(ctx, job_id, step)
    for shard, blob in blobs.items():
        if shards is None or shard in shards:
            body = bytearray(blob)
            store_results(ctx.blobs, job_id, step, body, decode_results(body))


# -- the step protocol through a real app (TestClient) ------------------------------------

def admin(client: TestClient) -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN_TOKEN}"}


def enroll(client: TestClient, name: str) -> tuple[str, dict[str, str]]:
    token = client.post("/v1/enrollment-tokens", json={}, headers=admin(client)).json()["token"]
    reg = client.post("/v1/devices/register", json={"enrollment_token": token, "name": name})
    assert reg.status_code == 201, reg.text
    body = reg.json()
    headers = {"Authorization": f"Bearer {body['device_token']}"}
    # an agent of today: every feature a job may ask for, and this machine's compute class
    hb = client.post(f"/v1/devices/{body['device_id']}/heartbeat",
                     json={"telemetry": [], "capabilities": capabilities()}, headers=headers)
    assert hb.status_code == 200, hb.text
    return body["device_id"], headers


def running_job(client: TestClient, devices: int = 2, **spec: Any) -> tuple[str, list[tuple[str, dict]]]:
    phones = [enroll(client, f"phone-{i}") for i in range(devices)]
    r = client.post("/v1/jobs", json=tiny_spec(placement={"min_devices": devices}, **spec),
                    headers=admin(client))
    assert r.status_code == 201, r.text
    ctx = context.get_context()
    run_reconcile(ctx)
    run_reconcile_job(ctx, r.json()["id"])
    return r.json()["id"], phones


def shards_of(job_id: str, device_id: str) -> list[int]:
    return [s for s, d, _ in assignments(context.get_context(), job_id) if d == device_id]
