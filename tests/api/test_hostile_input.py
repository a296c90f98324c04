"""Hostile input gets a clear 4xx that names the problem, never a 500, and tells a stranger
nothing about the machine: names that sneak a newline past a `$` anchor, Unicode digits where
a count belongs, offsets past Postgres' bigint, and /readyz's errors."""

from __future__ import annotations

import numpy as np
import pytest
from fastapi.testclient import TestClient
from starlette.exceptions import HTTPException

from api.steps.bulk_listener import content_length
from domain.settings import Settings
from domain.store.models import Dataset
from roots.api import create_app
from scheduler.celery_app import broker_problem, make_celery
from tests.api.conftest import make_settings, sample
from tests.support.arrays import npz_bytes


def npz() -> bytes:
    return npz_bytes(x=np.zeros((8, 1, 4, 4), np.float32), y=np.arange(8) % 2)


@pytest.mark.parametrize("name", ["adv5\n", "ok\n", "x\r\n", "a b"])
def test_a_dataset_name_with_a_newline_is_refused_and_nothing_is_stored(api, name: str) -> None:
    resp = api.post("/v1/datasets", data={"name": name},
                    files={"file": ("d.npz", npz(), "application/octet-stream")})
    assert resp.status_code == 422, resp.text
    assert "name" in str(resp.json()["detail"])
    assert api.count(Dataset) == 0


@pytest.mark.parametrize("labels", [{"rack\n": "a"}, {"rack": "a\n"}])
def test_a_label_with_a_newline_is_refused(api, labels: dict[str, str]) -> None:
    resp = api.post("/v1/enrollment-tokens", json={"labels": labels})
    assert resp.status_code == 422, resp.text
    assert "label" in str(resp.json()["detail"])


@pytest.mark.parametrize("path", ["/v1/devices", "/v1/jobs", "/v1/tokens"])
def test_an_offset_past_any_table_is_a_422_naming_it(api, path: str) -> None:
    resp = api.get(path, params={"offset": 2**63})
    assert resp.status_code == 422, resp.text
    assert "offset" in str(resp.json()["detail"])
    assert api.get(path, params={"offset": 2**31 - 1}).status_code == 200


def test_a_synthetic_dataset_with_unicode_digits_is_a_422(api) -> None:
    spec = {"name": "s", "model": {"arch": "logreg"}, "dataset": "synthetic:²x4x4:3:64",
            "global_batch_size": 8, "shards": 2, "epochs": 1}
    resp = api.post("/v1/jobs", json=spec)
    assert resp.status_code == 422, resp.text
    assert "dataset" in str(resp.json()["detail"])


@pytest.mark.parametrize("value", ["²", "٣", "1e3", "-5", " ", "99999999999999999999999"])
def test_content_length_on_the_bulk_port_is_ascii_digits_only(value: str) -> None:
    with pytest.raises(HTTPException, match="not a byte count") as refused:
        content_length(value, 1 << 20)
    assert refused.value.status_code == 400
    assert content_length(" 42 ", 1 << 20) == 42


def test_readyz_names_the_part_that_is_down_but_not_the_machine(sqlite_url, tmp_path) -> None:
    app = create_app(make_settings(sqlite_url, tmp_path / "d", redis_url="redis://127.0.0.1:1/0"))
    with TestClient(app) as client:
        resp = client.get("/readyz")
    app.state.engine.dispose()
    assert resp.status_code == 503
    checks = resp.json()["checks"]
    assert checks["redis"] == "redis unreachable (ConnectionError)"
    assert checks["broker"] == "the broker does not answer (OperationalError)"
    assert "127.0.0.1" not in resp.text and "Connection refused" not in resp.text


def test_heartbeats_after_hostile_input_still_work(api) -> None:
    device = api.register("after")
    api.post("/v1/datasets", data={"name": "bad\n"},
             files={"file": ("d.npz", npz(), "application/octet-stream")})
    assert api.heartbeat(device, {"telemetry": [sample(100.0)]}).status_code == 200


def test_a_model_too_large_to_allocate_is_a_422_with_its_size_and_the_limit(api) -> None:
    """10^9 classes: 17,000,000,000 parameters (63 GB). Counted, not allocated."""
    spec = {"name": "huge", "model": {"arch": "logreg"}, "dataset": "synthetic:1x4x4:1000000000:64",
            "global_batch_size": 8, "shards": 2, "epochs": 1}
    resp = api.post("/v1/jobs", json=spec)
    assert resp.status_code == 422, resp.text
    detail = str(resp.json()["detail"])
    assert "17,000,000,000 parameters" in detail and "200,000,000" in detail and "model" in detail
    assert api.get("/v1/jobs").json()["items"] == []


def test_a_broker_url_with_no_transport_is_a_readiness_problem_not_a_crash() -> None:
    problem = broker_problem(make_celery(Settings(redis_url="unix:///tmp/nothing.sock")))
    assert problem is not None and problem.kind == "transport"
    assert problem.public == "no broker transport for the configured URL (KeyError)"
