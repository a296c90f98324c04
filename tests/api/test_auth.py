"""Bearer tokens: who may do what, and what a refused request leaves behind (nothing)."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from domain.store.models import ApiToken, Device
from roots.api import create_app
from tests.api.conftest import make_settings


def test_missing_malformed_and_unknown_tokens_are_401(api):
    assert api.client.get("/v1/devices").status_code == 401
    bad_scheme = api.client.get("/v1/devices", headers={"Authorization": "Basic abc"})
    assert bad_scheme.status_code == 401 and "Bearer" in bad_scheme.json()["detail"]
    unknown = api.get("/v1/devices", token="phx-usr-nope")
    assert unknown.status_code == 401 and "invalid" in unknown.json()["detail"]


def test_user_token_reads_and_submits_but_cannot_administer(api):
    user = api.user_token()
    device = api.register()
    assert api.get("/v1/devices", token=user).status_code == 200
    submitted = api.post("/v1/jobs", token=user, json={
        "name": "mine", "model": {"arch": "logreg"}, "dataset": "digits",
        "global_batch_size": 16, "shards": 2, "epochs": 1})
    assert submitted.status_code == 201, submitted.text
    job = submitted.json()
    assert job["state"] == "Pending" and job["owner"] is not None
    listed = api.get("/v1/jobs", token=user)
    assert listed.status_code == 200 and [j["id"] for j in listed.json()["items"]] == [job["id"]]
    assert api.post(f"/v1/devices/{device['device_id']}/cordon", token=user).status_code == 403
    assert api.post("/v1/enrollment-tokens", token=user, json={}).status_code == 403
    assert api.post("/v1/tokens", token=user, json={"name": "x"}).status_code == 403
    assert api.delete(f"/v1/devices/{device['device_id']}", token=user).status_code == 403
    assert api.get(f"/v1/devices/{device['device_id']}").json()["state"] == "Ready"


def test_user_token_cannot_register_or_heartbeat(api):
    user = api.user_token()
    device = api.register()
    as_enrollment = api.client.post("/v1/devices/register",
                                    json={"enrollment_token": user, "name": "x"})
    assert as_enrollment.status_code == 401
    hb = api.post(f"/v1/devices/{device['device_id']}/heartbeat", token=user,
                  json={"telemetry": []})
    assert hb.status_code == 403
    assert api.count(Device) == 1


def test_device_token_acts_only_for_its_own_device(api):
    a, b = api.register("a"), api.register("b")
    as_b = api.post(f"/v1/devices/{b['device_id']}/heartbeat", token=a["device_token"],
                    json={"telemetry": [{"ts": 1.0, "battery_pct": 5}]})
    assert as_b.status_code == 403 and "own device" in as_b.json()["detail"]
    assert api.get(f"/v1/devices/{b['device_id']}/telemetry").json()["items"] == []
    assert api.get("/v1/jobs", token=a["device_token"]).status_code == 403
    assert api.get("/v1/devices", token=a["device_token"]).status_code == 403
    assert api.post("/v1/jobs", token=a["device_token"], json={}).status_code == 403


def test_revoked_user_token_stops_working_at_once(api):
    resp = api.post("/v1/tokens", json={"name": "bob"})
    token, token_id = resp.json()["token"], resp.json()["id"]
    assert api.get("/v1/jobs", token=token).status_code == 200  # now cached
    assert api.delete(f"/v1/tokens/{token_id}").json()["revoked"] is True
    revoked = api.get("/v1/jobs", token=token)
    assert revoked.status_code == 401 and "revoked" in revoked.json()["detail"]
    assert api.delete("/v1/tokens/tok-missing").status_code == 404


def test_expired_user_token_is_401(api):
    token = api.post("/v1/tokens", json={"name": "short", "expires_in_s": 60}).json()["token"]
    api.clock.advance(61)
    resp = api.get("/v1/jobs", token=token)
    assert resp.status_code == 401 and "expired" in resp.json()["detail"]


def test_secrets_are_stored_only_as_hashes(api):
    user = api.user_token()
    device = api.register()
    with api.app.state.session_factory() as session:
        stored = [row.token_hash for row in session.query(ApiToken)]
    assert user not in stored and device["device_token"] not in stored
    assert all(len(h) == 64 for h in stored)
    listed = api.get("/v1/tokens").json()["items"]
    assert {t["kind"] for t in listed} == {"user", "device"} and "token" not in listed[0]


def test_generated_admin_token_is_written_once_and_works(db_url, tmp_path, capsys):
    settings = make_settings(db_url, tmp_path / "d").model_copy(update={"admin_token": None})
    first = create_app(settings)
    printed = capsys.readouterr().out
    assert "generated an admin token" in printed
    secret = settings.admin_token_file.read_text().strip()
    assert secret not in printed
    settings.admin_token_file.unlink()
    second = create_app(settings)
    assert "admin token" not in capsys.readouterr().out
    assert not settings.admin_token_file.exists()  # generated once: never written again
    with TestClient(second) as client:
        ok = client.get("/v1/enrollment-tokens", headers={"Authorization": f"Bearer {secret}"})
        assert ok.status_code == 200
        assert client.get("/v1/enrollment-tokens",
                          headers={"Authorization": "Bearer phx-adm-guess"}).status_code == 401
    for app in (first, second):
        app.state.engine.dispose()


@pytest.mark.parametrize("path", ["/v1/tokens", "/v1/enrollment-tokens"])
def test_token_bodies_refuse_unknown_fields(api, path):
    resp = api.post(path, json={"name": "x", "admin": True})
    assert resp.status_code == 422
    assert "admin" in [err["field"] for err in resp.json()["detail"]]
