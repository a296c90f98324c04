"""Every operation of the API, asked with the wrong token of every kind, on both databases: no
token, another device's token, another user's token, a user's token on an admin's operation, a
device's token on a user's. Each is refused with the status that says why, and afterwards
nothing that was there has changed. The operations come from the live OpenAPI document, so a
route added later is in the matrix without editing this file."""

from __future__ import annotations

from typing import Any

import pytest

from domain.store.models import ApiToken, Dataset, Device, Job
from tests.api.test_jobs import SPEC
from tests.support.arrays import npz_bytes

PUBLIC = {("get", "/healthz"), ("get", "/readyz"), ("get", "/install.sh"),
          ("get", "/agent.tar.gz"), ("post", "/v1/devices/register")}
# a device's own protocol: a user's or an admin's token is not a device's
DEVICE_ONLY = {("post", "/v1/devices/{device_id}/heartbeat"), ("get", "/v1/devices/{device_id}/work"),
               ("get", "/v1/jobs/{job_id}/weights"), ("get", "/v1/jobs/{job_id}/shards/{shard}/data"),
               ("post", "/v1/jobs/{job_id}/steps/{step}/gradients"),
               ("post", "/v1/jobs/{job_id}/steps/{step}/diverged"),
               ("post", "/v1/devices/{device_id}/token"), ("post", "/v1/devices/{device_id}/logs"),
               ("post", "/v1/devices/{device_id}/upgrade-report")}
ADMIN_ONLY = {("get", "/v1/enrollment-tokens"), ("post", "/v1/enrollment-tokens"),
              ("delete", "/v1/enrollment-tokens/{token_id}"), ("get", "/v1/tokens"),
              ("post", "/v1/tokens"), ("delete", "/v1/tokens/{token_id}"),
              ("delete", "/v1/devices/{device_id}"), ("patch", "/v1/devices/{device_id}"),
              ("post", "/v1/devices/{device_id}/cordon"),
              ("post", "/v1/devices/{device_id}/uncordon"),
              ("post", "/v1/devices/{device_id}/drain"),
              ("post", "/v1/devices/{device_id}/logs/request"),
              ("get", "/v1/devices/{device_id}/logs"),
              ("put", "/v1/agent/rollout"), ("delete", "/v1/agent/rollout"),
              ("patch", "/v1/datasets/{name}")}
OWNED_JOB = {("get", "/v1/jobs/{job_id}"), ("post", "/v1/jobs/{job_id}/cancel"),
             ("get", "/v1/jobs/{job_id}/events"), ("get", "/v1/jobs/{job_id}/metrics"),
             ("get", "/v1/jobs/{job_id}/checkpoint")}
# alice's private dataset (domain.store.owners): to another user, as if it were not there
OWNED_DATASET = {("get", "/v1/datasets/{name}"), ("delete", "/v1/datasets/{name}")}


@pytest.fixture
def world(api) -> dict[str, Any]:
    """Alice's job and dataset, two phones, a user token each for alice and bob, an
    enrollment token."""
    import numpy as np

    alice, bob = api.user_token("alice"), api.user_token("bob")
    phone_a, phone_b = api.register("a", labels={"rack": "a"}), api.register("b")
    job = api.post("/v1/jobs", json=SPEC, token=alice).json()["id"]
    data = npz_bytes(x=np.zeros((8, 3), np.float32), y=np.arange(8) % 2)
    uploaded = api.post("/v1/datasets", token=alice, data={"name": "alices"},
                        files={"file": ("alices.npz", data, "application/octet-stream")})
    assert uploaded.status_code == 201, uploaded.text
    enrollment = api.post("/v1/enrollment-tokens", json={}).json()["id"]
    return {"alice": alice, "bob": bob, "a": phone_a, "b": phone_b, "job": job,
            "enrollment": enrollment,
            "params": {"device_id": phone_b["device_id"], "job_id": job, "token_id": enrollment,
                       "step": "0", "shard": "0", "upload_id": "upl-" + "0" * 32,
                       "name": "alices"}}


def operations(api) -> list[tuple[str, str]]:
    return sorted((method, path) for path, ops in api.app.openapi()["paths"].items()
                  for method in ops)


def ask(api, method: str, path: str, params: dict[str, str], token: str | None):
    url = path.format(**params)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    if method == "post" and path.endswith("/gradients"):
        return api.client.post(url, headers=headers, content=b"\0" * 64)
    body = {"json": {}} if method in ("post", "patch") else {}
    if path.endswith("/diverged"):  # a well-formed report: only the token may refuse it
        body = {"json": {"shard": 0, "reason": "shard 0: gradient is not finite"}}
    query = {"step": 0} if path.endswith("/weights") else {}
    return api.client.request(method.upper(), url, headers=headers, params=query, **body)


def snapshot(api, world: dict[str, Any]) -> tuple:
    with api.app.state.session_factory() as s:
        job = s.get(Job, world["job"])
        devices = sorted((d.id, d.state, d.cordoned, dict(d.labels or {}))
                         for d in s.query(Device).all())
        tokens = sorted((t.id, t.revoked) for t in s.query(ApiToken).all())
        datasets = sorted((d.name, d.owner, d.public) for d in s.query(Dataset).all())
        return (job.state, job.reason, devices, tokens, datasets)


def test_every_operation_refuses_every_wrong_token_and_changes_nothing(api, world) -> None:
    before = snapshot(api, world)
    phone_a = world["a"]["device_token"]
    refused: dict[tuple[str, str, str], int] = {}
    for method, path in operations(api):
        op = (method, path)
        if op in PUBLIC:
            continue
        cases = [("no token", None, {401}), ("a stranger", "phx-usr-" + "x" * 43, {401}),
                 ("another phone", phone_a, {403})]
        if op in ADMIN_ONLY:
            cases.append(("a user", world["bob"], {403}))
        if op in DEVICE_ONLY:
            cases.append(("a user", world["bob"], {403}))
            cases.append(("the admin", api.settings.admin_token.get_secret_value(), {403}))
        if op in OWNED_JOB | OWNED_DATASET:  # another user's: as if it were not there
            cases.append(("another user", world["bob"], {404}))
        for who, token, wanted in cases:
            answer = ask(api, method, path, world["params"], token)
            if answer.status_code not in wanted:
                refused[(method.upper(), path, who)] = answer.status_code
            assert answer.json().get("detail"), (method, path, who)  # says why
    assert refused == {}
    assert snapshot(api, world) == before
    mine = api.get(f"/v1/jobs/{world['job']}", token=world["alice"])
    assert mine.status_code == 200 and mine.json()["state"] == "Pending"
    assert api.heartbeat(world["b"]).status_code == 200  # B's token still works, B's own


def test_the_matrix_covers_every_operation(api) -> None:
    """A new route must be placed in a class above (or be a user's read): this lists the
    operations the matrix checks for more than a missing token."""
    classified = PUBLIC | DEVICE_ONLY | ADMIN_ONLY | OWNED_JOB | OWNED_DATASET
    users_reads = {op for op in operations(api) if op not in classified}
    # resumable uploads: any user opens one, only its opener sees it (tests/api/test_datasets.py)
    assert users_reads == {("get", "/v1/datasets"), ("post", "/v1/datasets"),
                           ("post", "/v1/datasets/uploads"),
                           ("get", "/v1/datasets/uploads/{upload_id}"),
                           ("put", "/v1/datasets/uploads/{upload_id}"),
                           ("post", "/v1/datasets/uploads/{upload_id}/complete"),
                           ("get", "/v1/devices"), ("get", "/v1/devices/{device_id}"),
                           ("get", "/v1/devices/{device_id}/events"),
                           ("get", "/v1/devices/{device_id}/telemetry"),
                           ("get", "/v1/jobs"), ("post", "/v1/jobs"),
                           ("get", "/v1/agent/rollout"), ("get", "/v1/agent/release-key")}
