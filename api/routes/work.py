"""The step protocol's routes (work, weights, shard data, gradient uploads); see
docs/contracts.md. The logic lives in `api.steps.protocol`, the shared handlers in
`api.steps.handlers`; routes only translate."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Query, Request, Response
from starlette.concurrency import run_in_threadpool

from api.deps import DeviceDep
from api.schemas.common import errors
from api.schemas.work import DivergedIn, DivergedOut, UploadOut, WorkOut
from api.steps.handlers import (
    MAX_WAIT_S,
    accept_upload,
    long_poll_work,
    wait_for_weights,
)

router = APIRouter(prefix="/v1", tags=["step protocol"],
                   responses=errors(401, 403, 409, 422, 429, 503))
OCTETS = "application/octet-stream"


@router.get("/devices/{device_id}/work", response_model=WorkOut)
async def get_work(device_id: str, request: Request, principal: DeviceDep,
               wait: float = Query(0.0, ge=0.0, le=MAX_WAIT_S)):
    """Long poll: answers as soon as the device has shards to compute, or after `wait` s.
    Served by `api.fast_path.FastPath` ahead of this route, through `api.steps.handlers.work_reply`."""
    return await long_poll_work(request.app.state, device_id, wait, request.url)


@router.get("/jobs/{job_id}/weights")
async def get_weights(
        job_id: str, request: Request, principal: DeviceDep, step: int = Query(..., ge=0),
        part: int | None = Query(None, ge=0, alias="slice", description="a sliced job's slice k alone "
                                  "(engine.slices); served once applied, before its step "
                                  "commits (header X-Phalanx-State names the state)"),
        wait: float = Query(0.0, ge=0.0, le=MAX_WAIT_S, description="with `slice`: wait up to "
                            "this long for that slice of the next step to be applied")):
    payload, headers = await wait_for_weights(request.app.state, principal.device_id, job_id,
                                              step, part, wait)
    return Response(payload, media_type=OCTETS, headers=headers)


@router.get("/jobs/{job_id}/shards/{shard}/data")
async def get_shard_data(
        job_id: str, shard: int, request: Request, principal: DeviceDep,
        start: int | None = Query(None, ge=0, description="the first sample of the chunk; the "
                                  "answer holds as many as a chunk holds (header "
                                  "X-Phalanx-Shard-Samples: the shard's total). Absent: "
                                  "the whole shard, when it fits one chunk (else 422)"),
        encoding: Literal["float32", "raw"] = Query(
            "float32", description="raw: the samples as stored (e.g. uint8) with the `mean` "
            "and `std` to normalize them by (engine.stored.normalize)")):
    """A shard's training samples (.npz of x and y), in chunks: a dataset bigger than the
    server's memory is read from disk a chunk at a time."""
    proto = request.app.state.step_protocol
    chunk = await run_in_threadpool(proto.shard_data, principal.device_id, job_id, shard,
                                    start, encoding == "raw")
    return Response(chunk.body, media_type=OCTETS,
                    headers={"X-Phalanx-Shard-Samples": str(chunk.total)})


@router.post("/jobs/{job_id}/steps/{step}/gradients", response_model=UploadOut)
async def upload_gradients(job_id: str, step: int, request: Request, principal: DeviceDep):
    """First upload of a shard wins; when the step's last shard arrives, apply_step is sent.
    The bulk listener (api.steps.bulk_listener) answers the same on its own port."""
    body = await _whole_body(request)
    return await run_in_threadpool(accept_upload, request.app.state, principal.device_id,
                                   job_id, step, body)


@router.post("/jobs/{job_id}/steps/{step}/diverged", response_model=DivergedOut)
def report_diverged(job_id: str, step: int, body: DivergedIn, request: Request,
                    principal: DeviceDep):
    """A device found its shard's loss or gradient not finite at the job's current step: the
    job fails with that reason (every device would compute the same bits)."""
    failed = request.app.state.step_protocol.diverged(principal.device_id, job_id, step,
                                                     body.shard, body.reason, body.kind)
    if failed:
        request.app.state.scheduler.job_changed(job_id)
    return DivergedOut(failed=failed)


async def _whole_body(request: Request) -> bytes:
    """The body without Starlette's final join, which copies even a body that came in one
    piece (api.steps.bulk_body hands over gradient uploads whole)."""
    chunks = [chunk async for chunk in request.stream() if chunk]
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)
