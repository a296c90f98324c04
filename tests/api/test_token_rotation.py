"""A superseded device token (issue 42, item 7): after a rotation the old token still carries
the device's ordinary calls through its grace period (a phone whose answer was lost keeps
working), but it can never rotate again (409), nor act beyond a device token; the device's
newest token is never ended by it. On Postgres and on SQLite (`api` runs on both)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from sqlalchemy import select

from domain.store.models import ApiToken


def rotate(api, device_id: str, token: str):
    return api.post(f"/v1/devices/{device_id}/token", token=token, json={})


def open_tokens(api, device_id: str) -> list[ApiToken]:
    """The device's tokens without an end (the one it may rotate with)."""
    with api.app.state.session_factory() as session:
        return list(session.scalars(select(ApiToken).where(
            ApiToken.device_id == device_id, ApiToken.revoked.is_(False),
            ApiToken.expires_at.is_(None))))


def as_device(device_id: str, token: str) -> dict[str, Any]:
    return {"device_id": device_id, "device_token": token}


def test_a_superseded_token_works_through_its_grace_but_never_rotates(api) -> None:
    phone = api.register("s10")
    device_id, first = phone["device_id"], phone["device_token"]
    rotated = rotate(api, device_id, first)
    assert rotated.status_code == 200, rotated.text
    second = rotated.json()["device_token"]
    grace = api.settings.device_token_rotation_grace_s

    # inside the grace: the old token's ordinary calls work, its rotation is refused, and the
    # refusal names the problem and changes nothing
    assert api.heartbeat(as_device(device_id, first)).status_code == 200
    refused = rotate(api, device_id, first)
    assert refused.status_code == 409, refused.text
    assert "superseded" in refused.json()["detail"]
    assert len(open_tokens(api, device_id)) == 1

    # one second before the grace ends: still the same
    api.clock.advance(grace - 1)
    assert api.heartbeat(as_device(device_id, first)).status_code == 200
    assert rotate(api, device_id, first).status_code == 409
    # at the end of the grace: the old token is over for everything, rotation included
    api.clock.advance(1)
    assert api.heartbeat(as_device(device_id, first)).status_code == 401
    late = rotate(api, device_id, first)
    assert late.status_code == 401 and "expired" in late.json()["detail"]

    # the newest token was never ended: it works long after, and it alone rotates
    api.clock.advance(10 * grace)
    assert api.heartbeat(as_device(device_id, second)).status_code == 200
    third = rotate(api, device_id, second)
    assert third.status_code == 200, third.text
    # and the token it replaced is superseded in turn
    assert rotate(api, device_id, second).status_code == 409
    assert api.heartbeat(as_device(device_id, third.json()["device_token"])).status_code == 200


def test_an_old_token_kept_by_someone_else_cannot_take_the_device(api) -> None:
    """The attack of item 7: whoever kept the phone's old token tries to rotate during the
    grace. Before the fix they got a token with no end and ended the phone's new one."""
    phone = api.register("victim")
    device_id, stolen = phone["device_id"], phone["device_token"]
    mine = rotate(api, device_id, stolen).json()["device_token"]  # the phone rotates
    taken = rotate(api, device_id, stolen)  # the thief, inside the grace
    assert taken.status_code == 409
    api.clock.advance(api.settings.device_token_rotation_grace_s + 1)
    assert api.heartbeat(as_device(device_id, mine)).status_code == 200
    assert api.heartbeat(as_device(device_id, stolen)).status_code == 401
    assert len(open_tokens(api, device_id)) == 1


def test_what_a_superseded_token_may_and_may_not_do(api) -> None:
    phone = api.register("s10")
    device_id, old = phone["device_id"], phone["device_token"]
    rotate(api, device_id, old)
    # the device's ordinary calls: the phone whose rotation answer was lost keeps working
    assert api.heartbeat(as_device(device_id, old)).status_code == 200
    assert api.get(f"/v1/devices/{device_id}/work", token=old).status_code == 200
    shipped = api.post(f"/v1/devices/{device_id}/logs", token=old,
                       json={"lines": [{"seq": 1, "ts": 1.0, "level": "INFO",
                                        "message": "hi"}]})
    assert shipped.status_code == 200, shipped.text
    # never a new credential, nor anything beyond a device token
    assert rotate(api, device_id, old).status_code == 409
    for method, path, body in [
        ("DELETE", f"/v1/devices/{device_id}", None),
        ("POST", f"/v1/devices/{device_id}/cordon", {}),
        ("POST", "/v1/tokens", {"name": "mine"}),
        ("POST", "/v1/enrollment-tokens", {}),
        ("PUT", "/v1/agent/rollout", {"max_parallel": 1}),
    ]:
        resp = api.client.request(method, path, headers=api.headers(old), json=body)
        assert resp.status_code == 403, (method, path, resp.text)
    # nor enroll a device with it
    enrolled = api.client.post("/v1/devices/register", json={
        "enrollment_token": old, "name": "twin", "labels": {}, "spec": {"cpu_cores": 8}})
    assert enrolled.status_code == 401, enrolled.text
    assert api.get(f"/v1/devices/{device_id}").json()["name"] == "s10"


def test_concurrent_rotations_with_one_token_mint_one_token(api) -> None:
    """A phone and a copy of its token rotating at the same moment: one wins, the others are
    told 409, and the device is left with exactly one token that has no end."""
    phone = api.register("s10")
    device_id, token = phone["device_id"], phone["device_token"]
    with ThreadPoolExecutor(6) as pool:
        answers = list(pool.map(lambda _: rotate(api, device_id, token), range(6)))
    codes = sorted(a.status_code for a in answers)
    assert codes == [200, 409, 409, 409, 409, 409], [a.text for a in answers]
    winner, = (a.json()["device_token"] for a in answers if a.status_code == 200)
    assert len(open_tokens(api, device_id)) == 1
    api.clock.advance(api.settings.device_token_rotation_grace_s + 1)
    assert api.heartbeat(as_device(device_id, winner)).status_code == 200
