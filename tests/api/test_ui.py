"""/ui: the fleet and its jobs for a browser, behind a login that keeps the token in an
HttpOnly cookie; a user sees their own jobs only."""

from __future__ import annotations

import re

from api.routes.ui import COOKIE

SPEC = {"name": "ui-job", "model": {"arch": "logreg"}, "dataset": "digits",
        "global_batch_size": 64, "shards": 4, "epochs": 1}


def test_without_a_token_the_ui_asks_for_one_and_refuses_a_bad_or_device_token(api):
    first = api.client.get("/ui")
    assert first.status_code == 200 and 'name="token"' in first.text
    assert "Fleet" not in first.text
    bad = api.client.post("/ui/login", data={"token": "phx-usr-nope"}, follow_redirects=False)
    assert bad.status_code == 401 and "not a valid" in bad.text and COOKIE not in bad.headers.get(
        "set-cookie", "")
    device = api.register("phone-1")
    as_device = api.client.post("/ui/login", data={"token": device["device_token"]},
                                follow_redirects=False)
    assert as_device.status_code == 401
    assert api.client.get("/ui/jobs/job-x", follow_redirects=False).status_code == 303


def test_a_user_logs_in_sees_the_fleet_and_their_own_jobs_live(api):
    api.register("phone-hot")
    api.register("phone-cool")
    alice, bob = api.user_token("alice"), api.user_token("bob")
    mine = api.post("/v1/jobs", token=alice, json=SPEC).json()
    theirs = api.post("/v1/jobs", token=bob, json={**SPEC, "name": "bobs-job"}).json()
    login = api.client.post("/ui/login", data={"token": alice}, follow_redirects=False)
    assert login.status_code == 303 and login.headers["location"] == "/ui"
    cookie = login.headers["set-cookie"]
    assert f"{COOKIE}=" in cookie and "HttpOnly" in cookie and "SameSite=strict" in cookie
    assert "Path=/ui" in cookie
    page = api.client.get("/ui").text
    assert '<meta http-equiv="refresh" content="5">' in page
    assert "phone-hot" in page and "phone-cool" in page
    assert f'href="/ui/jobs/{mine["id"]}"' in page and "bobs-job" not in page
    job = api.client.get(f"/ui/jobs/{mine['id']}")
    assert job.status_code == 200 and "ui-job" in job.text and "refresh" in job.text
    assert re.search(r"<h2>Events</h2>.*Submitted", job.text, re.S)
    assert api.client.get(f"/ui/jobs/{theirs['id']}").status_code == 404
    api.client.get("/ui/logout")
    assert 'name="token"' in api.client.get("/ui").text


def test_behind_a_tls_proxy_the_login_cookie_is_secure(api):
    token = api.user_token("carol")
    plain = api.client.post("/ui/login", data={"token": token}, follow_redirects=False)
    assert "Secure" not in plain.headers["set-cookie"]  # plain http: a browser would drop it
    proxied = api.client.post("/ui/login", data={"token": token}, follow_redirects=False,
                              headers={"X-Forwarded-Proto": "https"})
    assert "Secure" in proxied.headers["set-cookie"]
