"""Datasets: `digits` is always there; users upload .npz files with `x` and `y`."""

from __future__ import annotations

from fastapi import APIRouter, File, Form, UploadFile
from starlette.concurrency import run_in_threadpool

from api.deps import SessionDep, SettingsDep, UserDep
from api.errors import PayloadTooLarge
from api.schemas.common import Page, errors
from api.schemas.jobs import DatasetRead
from api.store import datasets
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
    dataset = await run_in_threadpool(datasets.validate_upload, data, settings.max_upload_bytes)
    return await run_in_threadpool(_store, session, name, data, dataset, settings)


def _store(session, name, data, dataset, settings) -> DatasetRead:
    with session.begin():
        row = datasets.store_dataset(session, name, data, dataset, settings.data_dir)
    return _uploaded(row)
