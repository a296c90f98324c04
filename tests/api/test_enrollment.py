"""Enrollment tokens and device registration: every refusal names its reason, stores nothing."""

from __future__ import annotations

import re

import pytest

from domain.store.models import ApiToken, Device, EnrollmentToken


def _register(api, token: str, **extra):
    body = {"enrollment_token": token, "name": "p", **extra}
    return api.client.post("/v1/devices/register", json=body)


def test_register_returns_the_device_token_once_and_merges_labels(api):
    """The enrollment token's labels are the admin's: a device adds its own but cannot change
    them (a phone enrolled into pool=untrusted cannot register as pool=trusted)."""
    token = api.enrollment_token(labels={"rack": "a", "pool": "untrusted"}, max_uses=3)
    resp = _register(api, token, labels={"pool": "trusted", "zone": "2"},
                     spec={"soc": "sm8150", "npu": "hexagon"})
    assert resp.status_code == 201
    body = resp.json()
    assert body["device_token"].startswith("phx-dev-") and body["state"] == "Ready"
    device = api.get(f"/v1/devices/{body['device_id']}").json()
    assert device["labels"] == {"rack": "a", "pool": "untrusted", "zone": "2"}
    [registered] = api.get(f"/v1/devices/{body['device_id']}/events").json()["items"]
    assert registered["kind"] == "Warning" and "pool='untrusted' (asked 'trusted')" in \
        registered["message"]
    assert registered["data"] == {"labels_refused": {"pool": "trusted"}}
    assert device["spec"] == {"soc": "sm8150", "npu": "hexagon"}  # unknown keys kept
    assert "device_token" not in device
    assert api.heartbeat(body).status_code == 200


def test_list_and_revoke_enrollment_tokens(api):
    api.enrollment_token(description="rack a")
    listed = api.get("/v1/enrollment-tokens").json()["items"]
    assert [t["description"] for t in listed] == ["rack a"] and "token" not in listed[0]
    revoked = api.delete(f"/v1/enrollment-tokens/{listed[0]['id']}")
    assert revoked.status_code == 200 and revoked.json()["revoked"] is True
    assert api.delete("/v1/enrollment-tokens/enr-nope").status_code == 404


@pytest.mark.parametrize("why", ["used up", "expired", "revoked", "unknown"])
def test_refused_enrollment_names_the_reason_and_stores_nothing(api, why):
    token = api.enrollment_token(max_uses=1, expires_in_s=3600)
    if why == "used up":
        assert _register(api, token).status_code == 201
    elif why == "expired":
        api.clock.advance(3601)
    elif why == "revoked":
        token_id = api.get("/v1/enrollment-tokens").json()["items"][0]["id"]
        api.delete(f"/v1/enrollment-tokens/{token_id}")
    else:
        token = "phx-enr-not-a-real-one"
    devices, tokens = api.count(Device), api.count(ApiToken)
    uses = api.get("/v1/enrollment-tokens").json()["items"][0]["uses"]
    resp = _register(api, token)
    # docs/api.md: 401 `invalid enrollment token`; 403 `enrollment token revoked`,
    # `enrollment token expired at …`, `enrollment token used up (N uses)`
    detail = {"unknown": r"invalid enrollment token", "revoked": r"enrollment token revoked",
              "used up": r"enrollment token used up \(1 uses\)",
              "expired": r"enrollment token expired at \d{4}-\d\d-\d\dT[\d:.]+\+00:00"}[why]
    assert resp.status_code == (401 if why == "unknown" else 403)
    assert re.fullmatch(detail, resp.json()["detail"]), resp.json()
    assert api.count(Device) == devices and api.count(ApiToken) == tokens
    assert api.get("/v1/enrollment-tokens").json()["items"][0]["uses"] == uses


@pytest.mark.parametrize("body, field", [
    ({"name": "p"}, "enrollment_token"),
    ({"enrollment_token": "t", "name": ""}, "name"),
    ({"enrollment_token": "t", "name": "p", "labels": {"bad key!": "x"}}, "labels"),
    ({"enrollment_token": "t", "name": "p", "labels": {"rack": 3}}, "labels.rack"),
    ({"enrollment_token": "t", "name": "p", "spec": {"cpu_cores": "many"}}, "spec.cpu_cores"),
    ({"enrollment_token": "t", "name": "p", "spec": {"ram_mb": -1}}, "spec.ram_mb"),
    ({"enrollment_token": "t", "name": "p", "owner": "me"}, "owner"),
])
def test_malformed_registration_is_422_naming_the_field(api, body, field):
    token = api.enrollment_token(max_uses=1)
    resp = api.client.post("/v1/devices/register", json={**body, "enrollment_token": token}
                           if "enrollment_token" in body else body)
    assert resp.status_code == 422
    assert field in [err["field"] for err in resp.json()["detail"]]
    assert api.count(Device) == 0
    assert api.get("/v1/enrollment-tokens").json()["items"][0]["uses"] == 0


@pytest.mark.parametrize("body", [{"max_uses": 0}, {"expires_in_s": -5}, {"max_uses": "x"},
                                  {"labels": {"k": "v" * 80}}])
def test_bad_enrollment_token_requests_are_422(api, body):
    assert api.post("/v1/enrollment-tokens", json=body).status_code == 422
    assert api.count(EnrollmentToken) == 0
