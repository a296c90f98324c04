"""Datasets: `digits` (and `synthetic…`) are every user's; users upload .npz files with `x`
and `y`, each upload its uploader's (domain.store.owners): another user's answers 404, to every
route and to a job naming it, unless an admin made it public."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

from fastapi import APIRouter, Query, Request
from fastapi.exceptions import RequestValidationError
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile

from api.deps import AdminDep, SessionDep, SettingsDep, UserDep
from api.schemas.common import Page, errors
from api.schemas.datasets import DatasetPatch, DatasetRead, UploadOpen, UploadRead
from domain.errors import Conflict, Invalid, PayloadTooLarge
from domain.store import datasets, owners, uploads
from domain.store.jobs import dataset_facts
from domain.store.tokens import Principal

router = APIRouter(prefix="/v1/datasets", tags=["datasets"],
                   responses=errors(401, 403, 409, 422))

COPY_BLOCK = 1024 * 1024

# the multipart form, declared by hand: the route reads it itself, after its dependencies
# (FastAPI reads Form/File parameters before it resolves them, so a stranger's body would be
# parsed and spooled before the 401; docs/api.md, "Authentication")
MULTIPART_BODY = {"requestBody": {"required": True, "content": {"multipart/form-data": {
    "schema": {"type": "object", "required": ["name", "file"], "title": "DatasetUpload",
               "properties": {
                   "name": {"type": "string", "title": "Name",
                            "description": "1-64 of A-Z a-z 0-9 _ . -, starting alphanumeric"},
                   "file": {"type": "string", "format": "binary", "title": "File",
                            "description": "an .npz with x and y"}}}}}}}


def _builtin(name: str, settings) -> DatasetRead:
    info = dataset_facts(name, settings.data_dir)
    return DatasetRead(name=name, builtin=True, n_train=info.n_train, n_val=info.n_val,
                       input_shape=list(info.input_shape), num_classes=info.num_classes)


def _uploaded(row, principal: Principal) -> DatasetRead:
    return DatasetRead(name=row.name, builtin=False, n_train=row.n_samples,
                       input_shape=row.input_shape, num_classes=row.num_classes,
                       size_bytes=row.size_bytes, sha256=row.sha256, created=row.created,
                       owner=row.owner if owners.may_change(row, principal) else None,
                       public=row.public, stored_bytes=row.stored_bytes)


@router.get("", response_model=Page[DatasetRead])
def list_datasets(principal: UserDep, session: SessionDep, settings: SettingsDep):
    """The built-ins, then the uploads this token may see: a user's own and the public ones
    (an admin: every one)."""
    builtin = [_builtin(name, settings) for name in datasets.BUILTIN]
    return {"items": builtin + [_uploaded(row, principal)
                                for row in datasets.list_visible(session, principal)]}


@router.post("", status_code=201, response_model=DatasetRead, responses=errors(413),
             openapi_extra=MULTIPART_BODY)
async def upload_dataset(request: Request, principal: UserDep, session: SessionDep,
                         settings: SettingsDep):
    """A multipart form: `name` and `file`, an .npz with `x` and `y` (optionally `x_val`,
    `y_val`), loaded without pickle. The body is read only after the token was checked."""
    form = await request.form(max_files=1, max_fields=1)
    try:
        name, file = form.get("name"), form.get("file")
        missing = [{"loc": ("body", key), "msg": "Field required", "type": "missing",
                    "input": None}
                   for key, value, kind in (("name", name, str), ("file", file, UploadFile))
                   if not isinstance(value, kind)]
        if missing:
            raise RequestValidationError(missing)
        assert isinstance(name, str) and isinstance(file, UploadFile)
        datasets.check_name(name)
        return await run_in_threadpool(_store_form_file, session, name, file, principal,
                                       settings)
    finally:
        await form.close()


def _store_form_file(session, name: str, file: UploadFile, principal: Principal,
                     settings) -> DatasetRead:
    """Copy the spooled file beside the datasets (in blocks, hashing as it goes), then store
    it as a resumable upload's file is stored."""
    with datasets.staging(settings.data_dir, name) as staged:
        source = staged.with_suffix(".npz")
        try:
            digest, size = hashlib.sha256(), 0
            file.file.seek(0)
            with source.open("wb") as out:
                while block := file.file.read(COPY_BLOCK):
                    size += len(block)
                    if size > settings.max_upload_bytes:
                        raise PayloadTooLarge(f"dataset file over the "
                                              f"{settings.max_upload_bytes}-byte limit")
                    digest.update(block)
                    out.write(block)
            return _store(session, name, source, staged, settings, principal,
                          max_bytes=settings.max_upload_bytes, sha256=digest.hexdigest(),
                          size=size)
        finally:
            source.unlink(missing_ok=True)


def _store(session, name: str, source: Path, staged: Path, settings, principal: Principal, *,
           max_bytes: int, sha256: str, size: int) -> DatasetRead:
    """Unpack (up to `max_bytes`, and what the user's quota has left) and check the .npz at
    `source`, in blocks, then publish it as `name`, the principal's."""
    quota = settings.user_max_dataset_bytes
    stated = datasets.stated_bytes(source)
    if stated is not None:  # past the quota: refused before anything is unpacked
        datasets.check_room(session, principal, quota, stated)
        session.rollback()  # the count's read ends here: the store below counts again
    dataset = datasets.validate_upload(source, staged, max_bytes)
    with session.begin():
        row = datasets.store_dataset(session, name, staged, dataset, settings.data_dir,
                                     sha256=sha256, size=size, principal=principal,
                                     quota=quota)
    return _uploaded(row, principal)


@router.get("/{name}", response_model=DatasetRead, responses=errors(404))
def read_dataset(name: str, principal: UserDep, session: SessionDep, settings: SettingsDep):
    """One dataset: a built-in, or an upload this token may see (404 for another user's)."""
    if datasets.is_builtin(name):
        return _builtin(name, settings)
    return _uploaded(datasets.find(session, name, principal), principal)


@router.delete("/{name}", response_model=DatasetRead, responses=errors(404))
def delete_dataset(name: str, principal: UserDep, session: SessionDep, settings: SettingsDep):
    """Remove an upload: its row and its files. Its owner or an admin; 404 for another user's,
    403 for another user's public one and for a built-in, 409 while an unfinished job trains
    on it."""
    trash = None
    try:
        with session.begin():
            row, trash = datasets.delete_dataset(session, name, principal, settings.data_dir)
            answer = _uploaded(row, principal)
    except BaseException:
        if trash is not None:  # the row is still there: so is its folder
            datasets.restore(trash, settings.data_dir / "datasets" / name)
        raise
    shutil.rmtree(trash, ignore_errors=True)
    return answer


@router.patch("/{name}", response_model=DatasetRead, responses=errors(404))
def patch_dataset(name: str, body: DatasetPatch, principal: AdminDep, session: SessionDep):
    """Share a dataset with every user (`{"public": true}`), or stop sharing it: an admin's
    act only (a user's token gets 403, even for their own dataset)."""
    with session.begin():
        row = datasets.set_public(session, name, body.public)
    return _uploaded(row, principal)


# -- resumable uploads (domain/store/uploads.py says the protocol) ---------------------------------

@router.post("/uploads", status_code=201, response_model=UploadRead, responses=errors(413))
def open_upload(body: UploadOpen, principal: UserDep, session: SessionDep,
                settings: SettingsDep):
    """Open a resumable upload of a dataset file: its name, size and SHA-256 first. 413 when
    the file is over the limit, or cannot fit what is left of the user's quota."""
    datasets.check_name(body.name)
    datasets.check_free(session, body.name)
    datasets.check_room(session, principal, settings.user_max_dataset_bytes, body.size)
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
             responses=errors(404, 413))
def complete_upload(upload_id: str, principal: UserDep, session: SessionDep,
                    settings: SettingsDep):
    """Every byte is there and matches the SHA-256: validate the .npz and store the dataset.
    One completion at a time: another one while it runs, or after it stored the dataset, is
    409 (a lost answer asked again says which dataset it became)."""
    upload = uploads.find_to_complete(settings.data_dir, upload_id, principal)
    with uploads.completing(settings.data_dir, upload, principal):
        part = uploads.assembled(settings.data_dir, upload)  # 409 while bytes are missing
        try:
            with datasets.staging(settings.data_dir, upload.name) as staged:
                stored = _store(session, upload.name, part, staged, settings, principal,
                                max_bytes=settings.max_dataset_bytes, sha256=upload.sha256,
                                size=upload.size)
        except (Invalid, Conflict, PayloadTooLarge):
            # refused for good (a bad file, a taken name, no room left): the parts go
            uploads.close(settings.data_dir, upload_id)
            raise
        uploads.finish(settings.data_dir, upload)
    return stored
