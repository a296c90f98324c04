"""A device's compute class (its heartbeat's `capabilities.compute_class`): typed and bounded at
the door, stored, shown by the device reads and /ui; a job's `exactness`, and a `class` job's
compute class with whether the server is of it; a dry run names the classes a class job could
take."""

from __future__ import annotations

import pytest
from sqlalchemy import update

from domain.store.models import Device, Job
from engine.compute_class import fingerprint
from tests.support.env import ADMIN_TOKEN as ADMIN

FACTS = {"machine": "x86_64", "numpy": "2.4.6",
         "blas": {"library": "openblas", "version": "0.3.31.188.0", "kernel": "SkylakeX"},
         "simd": "X86_V4", "simd_features": 42, "fingerprint": "be23673d0b4b503b"}
ARM = {"machine": "aarch64", "numpy": "2.1.3",
       "blas": {"library": "openblas", "version": "0.3.28", "kernel": None},
       "simd": "ASIMDHP", "simd_features": 9, "fingerprint": "0123456789abcdef"}
FEATURES = ["augment", "label_smoothing", "upload_precision", "portable"]
SPEC = {"name": "cc", "model": {"arch": "logreg"}, "dataset": "digits",
        "global_batch_size": 64, "shards": 4, "epochs": 1}


def beat(api, device, facts, **caps):
    return api.heartbeat(device, {"telemetry": [], "capabilities": {
        "features": FEATURES, "compute_class": facts, **caps}})


def test_a_heartbeats_compute_class_is_stored_and_shown_with_the_rest_as_sent(api):
    phone = api.register("phone-1")
    resp = beat(api, phone, FACTS, archs=["cnn"], something_new={"dropped": [1, 2]})
    assert resp.status_code == 200, resp.text
    one = api.get(f"/v1/devices/{phone['device_id']}").json()
    # a key a later agent adds is dropped (docs/api.md): the server reads none of them
    assert one["capabilities"] == {"features": FEATURES, "compute_class": FACTS,
                                   "archs": ["cnn"], "backends": None}
    assert one["compute_class"] == "x86_64 openblas SkylakeX X86_V4 #be23673d"
    (listed,) = api.get("/v1/devices").json()["items"]
    assert listed["capabilities"]["compute_class"] == FACTS
    assert listed["compute_class"] == one["compute_class"]
    # the BLAS facts may be unknown (null); the label says what is known
    assert beat(api, phone, {**ARM, "blas": None}).status_code == 200
    shown = api.get(f"/v1/devices/{phone['device_id']}").json()
    assert shown["capabilities"]["compute_class"]["blas"] is None
    assert shown["compute_class"] == "aarch64 ASIMDHP #01234567"
    # an agent that says nothing of its class (older) shows none
    old = api.register("phone-old")
    assert api.heartbeat(old, {"telemetry": [], "capabilities": {"features": []}}).status_code == 200
    assert api.get(f"/v1/devices/{old['device_id']}").json()["compute_class"] is None


@pytest.mark.parametrize("change, where", [
    ({"fingerprint": "BE23673D0B4B503B"}, ["fingerprint"]),  # not lowercase hex
    ({"fingerprint": "be23673d0b4b503"}, ["fingerprint"]),  # 15 digits
    ({"fingerprint": "zz23673d0b4b503b"}, ["fingerprint"]),
    ({"machine": ["x86_64"]}, ["machine"]),  # a list where a string goes
    ({"numpy": 2}, ["numpy"]),
    ({"machine": "x" * 65}, ["machine"]),
    ({"simd_features": 1025}, ["simd_features"]),
    ({"simd_features": "42"}, ["simd_features"]),
    ({"blas": {"library": ["openblas"]}}, ["blas", "library"]),
    ({"blas": "openblas"}, ["blas"]),
])
def test_a_malformed_compute_class_is_422_naming_it_and_changes_nothing(api, change, where):
    phone = api.register("phone-1")
    assert beat(api, phone, FACTS).status_code == 200
    resp = beat(api, phone, {**FACTS, **change})
    assert resp.status_code == 422, resp.text
    locs = [err["loc"] for err in resp.json()["detail"]]
    assert ["body", "capabilities", "compute_class", *where] in locs, locs
    assert api.get(f"/v1/devices/{phone['device_id']}").json()["capabilities"][
        "compute_class"] == FACTS
    missing = {k: v for k, v in FACTS.items() if k != "fingerprint"}
    assert beat(api, phone, missing).status_code == 422
    assert beat(api, phone, [FACTS]).status_code == 422


def test_exactness_is_portable_or_class_and_anything_else_is_a_422_naming_it(api):
    resp = api.post("/v1/jobs", json={**SPEC, "exactness": "fast"})
    assert resp.status_code == 422, resp.text
    (err,) = resp.json()["detail"]
    assert err["field"] == "exactness" and "'portable' or 'class'" in err["msg"], err
    for value in ("portable", "class"):
        made = api.post("/v1/jobs", json={**SPEC, "exactness": value})
        assert made.status_code == 201 and made.json()["spec"]["exactness"] == value, made.text
    assert api.count(Job) == 2
    torch = {**SPEC, "exactness": "portable", "placement": {"backend": "torch"}}
    resp = api.post("/v1/jobs", json=torch)
    assert resp.status_code == 422 and "placement.backend torch cannot apply" in resp.text
    made = api.post("/v1/jobs", json={**torch, "exactness": "class"})
    assert made.status_code == 201, made.text


def test_a_job_shows_its_exactness_and_a_class_jobs_class_with_whether_the_server_is_of_it(api):
    portable = api.post("/v1/jobs", json={**SPEC, "exactness": "portable"}).json()
    assert portable["spec"]["exactness"] == portable["exactness"] == "portable"
    assert portable["compute_class"] is None and portable["server_is_reference"] is True
    pinned = api.post("/v1/jobs", json={**SPEC, "exactness": "class"}).json()
    assert pinned["exactness"] == "class" and pinned["compute_class"] is None
    assert pinned["server_is_reference"] is None  # not placed yet: no class chosen
    for chosen, here in ((fingerprint(), True), ("0123456789abcdef", False)):
        with api.app.state.session_factory.begin() as session:
            session.execute(update(Job).where(Job.id == pinned["id"]).values(compute_class=chosen))
        got = api.get(f"/v1/jobs/{pinned['id']}").json()
        assert got["compute_class"] == chosen and got["server_is_reference"] is here
    # the job's page (the report's header) says it too
    login = api.client.post("/ui/login", data={"token": ADMIN}, follow_redirects=False)
    assert login.status_code == 303
    page = api.client.get(f"/ui/jobs/{pinned['id']}").text
    assert "<td>exactness</td><td>class</td>" in page
    assert "#0123456789abcdef (not the server&#x27;s" in page
    assert "<td>exactness</td><td>portable</td>" in api.client.get(
        f"/ui/jobs/{portable['id']}").text


def test_a_dry_run_shows_the_exactness_and_the_classes_a_class_job_could_take(api):
    for name, facts in (("x-1", FACTS), ("x-2", FACTS), ("arm-1", ARM)):
        assert beat(api, api.register(name), facts).status_code == 200
    api.heartbeat(api.register("old"), {"telemetry": [], "capabilities": {"features": []}})
    answer = api.post("/v1/jobs?dry_run=true", json={**SPEC, "exactness": "class"}).json()
    placement = answer["placement"]
    assert placement["exactness"] == "class" and placement["eligible"] == 3
    assert placement["reasons"] == {"agent reports no compute class (upgrade it)": 1}
    classes = placement["compute_classes"]
    assert [(c["fingerprint"], c["devices"]) for c in classes] == [
        (FACTS["fingerprint"], 2), (ARM["fingerprint"], 1)]  # the first: what it would take
    assert classes[0]["label"] == "x86_64 openblas SkylakeX X86_V4 #be23673d"
    portable = api.post("/v1/jobs?dry_run=true", json={**SPEC, "exactness": "portable"}).json()
    assert portable["placement"]["exactness"] == "portable"
    assert "compute_classes" not in portable["placement"]
    assert portable["placement"]["reasons"] == {"agent lacks portable (upgrade it)": 1}


def test_the_fleet_page_shows_each_phones_compute_class(api):
    beat(api, api.register("phone-x"), FACTS)
    api.register("phone-new")
    login = api.client.post("/ui/login", data={"token": api.user_token("alice")},
                            follow_redirects=False)
    assert login.status_code == 303
    page = api.client.get("/ui").text
    assert '<th><a href="?sort=class" data-sort="class">compute class</a></th>' in page
    assert "<td>x86_64 openblas SkylakeX X86_V4 #be23673d</td>" in page
    # a stored value from before the schema is shown as none, not a 500
    with api.app.state.session_factory.begin() as session:
        session.execute(update(Device).where(Device.name == "phone-new")
                        .values(capabilities={"compute_class": {"fingerprint": ["x"]}}))
    assert api.client.get("/ui").status_code == 200
    assert all(d["compute_class"] is None for d in api.get("/v1/devices").json()["items"]
               if d["name"] == "phone-new")
