"""Datasets: `digits` is always there; users upload .npz files with `x` and `y`."""

from __future__ import annotations

import hashlib
from pathlib import Path

from fastapi import APIRouter, File, Form, Query, Request, UploadFile
from starlette.concurrency import run_in_threadpool

from api.deps import SessionDep, SettingsDep, UserDep
from api.errors import Conflict, Invalid, PayloadTooLarge
from api.schemas.common import Page, errors
from api.schemas.jobs import DatasetRead, UploadOpen, UploadRead
from api.store import datasets, uploads
from api.store.jobs import dataset_facts

router = APIRouter(prefix="/v1/datasets", tags=["datasets"],
                   responses=errors(401, 403, 409, 422))


def _builtin(name: str, settings) -> DatasetRead:
    info = dataset_facts(name, settings.data_dir)
    return DatasetRead(name=name, builtin=True, n_train=info.n_train, n_val=info.n_val,
                       input_shape=list(info.input_shape), num_classes=info.num_classes)


def _uploaded(row) -> DatasetRead:
    return DatasetRead(name=row.name, builtin=False, n_train=row.n_samples,
                       input_shape=row.input_shape, num_classes=row.num_classes,
                       size_bytes=row.size_bytes, sha256=row.sha256, created=row.created)


@router.get("", response_model=Page[DatasetRead])
def list_datasets(_: UserDep, session: SessionDep, settings: SettingsDep):
    builtin = [_builtin(name, settings) for name in datasets.BUILTIN]
    return {"items": builtin + [_uploaded(row) for row in datasets.list_uploaded(session)]}


@router.post("", status_code=201, response_model=DatasetRead)
async def upload_dataset(_: UserDep, session: SessionDep, settings: SettingsDep,
                 name: str = Form(...), file: UploadFile = File(...)):
    """An .npz with `x` and `y` (optionally `x_val`, `y_val`), loaded without pickle."""
    datasets.check_name(name)
    data = await file.read(settings.max_upload_bytes + 1)
    if len(data) > settings.max_upload_bytes:
        raise PayloadTooLarge(f"dataset file over the {settings.max_upload_bytes}-byte limit")
    return await run_in_threadpool(_store_bytes, session, name, data, settings)


def _store_bytes(session, name: str, data: bytes, settings) -> DatasetRead:
    with datasets.staging(settings.data_dir, name) as staged:
        source = staged.with_suffix(".npz")
        try:
            source.write_bytes(data)
            return _store(session, name, source, staged, settings,
                          max_bytes=settings.max_upload_bytes,
                          sha256=hashlib.sha256(data).hexdigest(), size=len(data))
        finally:
            source.unlink(missing_ok=True)


def _store(session, name: str, source: Path, staged: Path, settings, *, max_bytes: int,
           sha256: str, size: int) -> DatasetRead:
    """Unpack (up to `max_bytes`) and check the .npz at `source`, in blocks, then publish it
    as `name`."""
    dataset = datasets.validate_upload(source, staged, max_bytes)
    with session.begin():
        row = datasets.store_dataset(session, name, staged, dataset, settings.data_dir,
                                     sha256=sha256, size=size)
    return _uploaded(row)


# -- resumable uploads (api/store/uploads.py says the protocol) ---------------------------------

@router.post("/uploads", status_code=201, response_model=UploadRead)
def open_upload(body: UploadOpen, principal: UserDep, session: SessionDep,
                settings: SettingsDep):
    """Open a resumable upload of a dataset file: its name, size and SHA-256 first."""
    datasets.check_name(body.name)
    datasets.check_free(session, body.name)
    upload = uploads.open_upload(settings.data_dir, body.name, body.size, body.sha256,
                                 principal, settings.max_dataset_bytes)
    return upload.answer(0)


@router.get("/uploads/{upload_id}", response_model=UploadRead, responses=errors(404))
def upload_status(upload_id: str, principal: UserDep, settings: SettingsDep):
    """Where an upload stands: the offset to send the next chunk from."""
    upload, offset = uploads.find(settings.data_dir, upload_id, principal)
    return upload.answer(offset)


@router.put("/uploads/{upload_id}", response_model=UploadRead, responses=errors(404, 413),
            openapi_extra={"requestBody": {"required": True, "content": {
                "application/octet-stream": {"schema": {"type": "string",
                                                        "format": "binary"}}}}})
async def upload_chunk(upload_id: str, request: Request, principal: UserDep,
                       settings: SettingsDep,
                       offset: int = Query(ge=0, description="where this chunk starts: the "
                                           "upload's current offset")):
    """Append one chunk (raw bytes, at most `chunk_max_bytes`); 409 with the offset to resume
    from when `offset` is not where the upload stands."""
    upload, _ = uploads.find(settings.data_dir, upload_id, principal)
    received = bytearray()
    async for part in request.stream():  # never more than one chunk's worth in memory
        received += part
        if len(received) > uploads.CHUNK_MAX_BYTES:
            raise PayloadTooLarge(f"a chunk is at most {uploads.CHUNK_MAX_BYTES} bytes")
    at = await run_in_threadpool(uploads.append, settings.data_dir, upload, offset,
                                 bytes(received))
    return upload.answer(at)


@router.post("/uploads/{upload_id}/complete", status_code=201, response_model=DatasetRead,
             responses=errors(404))
def complete_upload(upload_id: str, principal: UserDep, session: SessionDep,
                    settings: SettingsDep):
    """Every byte is there and matches the SHA-256: validate the .npz and store the dataset."""
    upload, _ = uploads.find(settings.data_dir, upload_id, principal)
    part = uploads.assembled(settings.data_dir, upload)  # 409 while bytes are missing
    try:
        with datasets.staging(settings.data_dir, upload.name) as staged:
            stored = _store(session, upload.name, part, staged, settings,
                            max_bytes=settings.max_dataset_bytes, sha256=upload.sha256,
                            size=upload.size)
    except (Invalid, Conflict):  # refused for good (a bad file, a taken name): the parts go
        uploads.close(settings.data_dir, upload_id)
        raise
    uploads.close(settings.data_dir, upload_id)
    return stored
