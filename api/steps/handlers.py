"""The step protocol's handlers, shared by the FastAPI routes (api.routes.work), the ASGI fast
path (api.fast_path) and the bulk listener (api.steps.bulk_listener): the work long poll, the
weights and an upload. Blocking calls are marked; the logic of each lives in `api.steps.protocol`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Any

from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import URL

from api.app_state import AppState
from api.deps import check_device, principal_for
from api.metrics import SHARD_RESULTS, SLICES_SERVED, UPLOADED_RESULTS
from api.schemas.common import parse_query
from api.schemas.work import WorkOut
from api.steps.protocol import NotYetApplied, StateMissing
from domain.errors import DomainError

log = logging.getLogger(__name__)

MAX_WAIT_S = 30.0  # the longest long poll a device may ask for


class _WorkQuery(BaseModel):
    wait: float = Field(0.0, ge=0.0, le=MAX_WAIT_S)


async def work_reply(state: AppState, device_id: str, authorization: str | None,
                     scope: dict[str, Any]) -> bytes:
    """The work route (api.routes.work) without FastAPI: the same token rule (DeviceDep), the same 422 for a
    bad `wait`, the same answer through the same response model."""
    check_device(await principal_for(state.authenticator, authorization), device_id)
    query = parse_query(_WorkQuery, scope["query_string"].decode("latin-1"))
    answer = await long_poll_work(state, device_id, query.wait, URL(scope=scope))
    return WorkOut.model_validate(answer).model_dump_json().encode()


async def long_poll_work(state: AppState, device_id: str, wait: float, url: URL) -> dict[str, Any]:
    """The device's assignment, waiting up to `wait` s for one; no assignment at the timeout
    or once the server is stopping (the agent asks again, of the next server)."""
    deadline = time.monotonic() + min(wait, state.settings.work_long_poll_max_s)
    while True:
        since = state.version_watch.snapshot()
        found = await run_in_threadpool(state.step_protocol.work, device_id)
        remaining = deadline - time.monotonic()
        if found is not None:
            return {"assignment": replace(found, bulk_url=_bulk_url(state, url))}
        if remaining <= 0 or state.version_watch.stopping:
            return {"assignment": None}
        await state.version_watch.wait_change(since, remaining)


def _bulk_url(state: AppState, url: URL) -> str | None:
    listener = state.bulk_listener
    return listener.url_for(url.scheme, url.hostname) if listener else None


WEIGHTS_HEADERS = {"Cache-Control": "private, max-age=86400"}
STATE_HEADER = "X-Phalanx-State"  # the nonce of the state a weights message is


def serve_weights(state: AppState, device_id: str, job_id: str, step: int,
                  part: int | None = None) -> tuple[bytes | memoryview, dict[str, str]]:
    """The weights message of step `step` (`part`: one slice's) and its headers; blocking.
    Refusals are `DomainError`s (one mapping to HTTP per transport: api.error_responses)."""
    try:
        payload, nonce, ahead = state.step_protocol.weights(device_id, job_id, step, part)
    except StateMissing:
        state.scheduler.job_changed(job_id)  # restore now, not at the next beat
        raise
    if part is not None:
        SLICES_SERVED.labels("ahead" if ahead else "committed").inc()
    return payload, {**WEIGHTS_HEADERS, **({STATE_HEADER: nonce} if nonce else {})}


async def wait_for_weights(state: AppState, device_id: str, job_id: str, step: int,
                           part: int | None, wait: float
                           ) -> tuple[bytes | memoryview, dict[str, str]]:
    """`serve_weights`, waiting up to `wait` s for a slice of the next step to be applied
    (each slice applied moves the slices' version key, and so does a sliced step's commit,
    after the version key: the rows this process reads are the new ones by then). Once the
    server is stopping it answers as at the timeout: not yet applied."""
    deadline = time.monotonic() + min(wait, state.settings.work_long_poll_max_s)
    while True:
        since = state.slices_watch.snapshot()
        try:
            return await run_in_threadpool(serve_weights, state, device_id, job_id, step, part)
        except NotYetApplied:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or state.slices_watch.stopping:
                raise
            await state.slices_watch.wait_change(since, remaining)


def accept_upload(state: AppState, device_id: str, job_id: str, step: int,
                  body: bytes | memoryview) -> dict[str, Any]:
    """One device's upload for step `step` of `job_id` -> its answer; blocking."""
    up = state.step_protocol.upload(device_id, job_id, step, body)
    SHARD_RESULTS.labels("accepted").inc(len(up.accepted))
    SHARD_RESULTS.labels("duplicate").inc(len(up.duplicates))
    UPLOADED_RESULTS.labels("partial").inc(up.partials)
    UPLOADED_RESULTS.labels("shard").inc(up.shard_results)
    if up.complete:  # sent once a claim period (a TTL key): a repeat costs one SET NX
        state.scheduler.step_complete(job_id, step)
    return {"accepted": up.accepted, "duplicates": up.duplicates}


async def carries_device_token(state: AppState, scope: dict[str, Any]) -> bool:
    """Whether the request's headers hold a valid device token: only then is an upload's
    body read (a stranger's costs the server its headers)."""
    authorization = next((value.decode("latin-1") for name, value in scope["headers"]
                          if name == b"authorization"), None)
    try:
        principal = await principal_for(state.authenticator, authorization)
    except DomainError:
        return False
    return principal.kind == "device"


def is_gradient_upload(path: object) -> bool:
    return isinstance(path, str) and path.startswith("/v1/jobs/") and path.endswith("/gradients")
