"""Jobs: complete validation at the door, reads, cancel, events, metrics and checkpoints."""

from __future__ import annotations

import io

import numpy as np
import pytest

from agent.runtime.agent import FEATURES, compute_class
from domain.store.models import Checkpoint, Event, Job, ShardAssignment, StepMetric

SPEC = {"name": "digits-cnn", "model": {"arch": "cnn"}, "dataset": "digits",
        "global_batch_size": 256, "shards": 16, "epochs": 20, "seed": 0,
        "optimizer": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.0001, "warmup_epochs": 2,
                      "schedule": "cosine"},
        "placement": {"min_devices": 1, "max_devices": 8, "selector": {"rack": "a"},
                      "min_battery": 20, "max_temp_c": 45}}


def _with(path: str, value):
    spec = {**SPEC, "optimizer": dict(SPEC["optimizer"]), "placement": dict(SPEC["placement"]),
            "model": dict(SPEC["model"])}
    *parents, leaf = path.split(".")
    target = spec
    for key in parents:
        target = target[key]
    target[leaf] = value
    return spec


def test_submit_returns_201_with_the_job_and_defaults_filled_in(api):
    resp = api.post("/v1/jobs", token=api.user_token(), json=SPEC)
    assert resp.status_code == 201, resp.text
    job = resp.json()
    assert job["id"].startswith("job-") and job["state"] == "Pending" and job["step"] == 0
    # digits: 1438 training samples, 16 shards of >= 89, 16 per shard per step -> 5 steps/epoch
    assert job["total_steps"] == 20 * 5
    assert job["spec"]["optimizer"]["nesterov"] is False and job["spec"]["checkpoint_every"] == 50
    assert job["devices"] == [] and job["metrics"] == {}
    assert api.get(f"/v1/jobs/{job['id']}").json()["spec"] == job["spec"]
    assert [e["reason"] for e in api.get(f"/v1/jobs/{job['id']}/events").json()["items"]] == ["Submitted"]


@pytest.mark.parametrize("path, value, field", [
    ("name", "", "name"),
    ("model.arch", "transformer", "model.arch"),
    ("model.width", 8, "model.width"),
    ("model.depth", 3, "model.depth"),
    ("global_batch_size", 0, "global_batch_size"),
    ("global_batch_size", "big", "global_batch_size"),
    ("shards", 7, "shards"),  # 256 % 7
    ("shards", 2048, "shards"),  # more shards than digits has samples
    ("global_batch_size", 4096, "global_batch_size"),  # 256/shard > the 89 samples a shard holds
    ("epochs", 0, "epochs"),
    ("seed", -1, "seed"),
    ("optimizer.lr", 0, "optimizer.lr"),
    ("optimizer.momentum", 1.5, "optimizer.momentum"),
    ("optimizer.schedule", "linear", "optimizer.schedule"),
    ("exactness", "fast", "exactness"),
    ("optimizer.warmup_epochs", 20, ""),
    ("optimizer.beta", 0.9, "optimizer.beta"),
    ("placement.min_devices", 9, "placement.max_devices"),
    ("placement.max_temp_c", 500, "placement.max_temp_c"),
    ("placement.backend", "cuda", "placement.backend"),
    ("placement.selector", {"rack": 1}, "placement.selector.rack"),
    ("priority", 5000, "priority"),
    ("checkpoint_every", 0, "checkpoint_every"),
    ("owner", "me", "owner"),
])
def test_bad_specs_are_422_naming_the_field_and_store_nothing(api, path, value, field):
    resp = api.post("/v1/jobs", json=_with(path, value))
    assert resp.status_code == 422, resp.text
    detail = resp.json()["detail"]
    assert field in [err["field"] for err in detail], detail
    if path == "optimizer.warmup_epochs":
        assert "warmup_epochs" in detail[0]["msg"]
    assert api.count(Job) == 0 and api.count(Event) == 0


def test_not_json_object_bodies_are_422(api):
    for body in ([], "spec", 3):
        assert api.post("/v1/jobs", json=body).status_code == 422
    assert api.count(Job) == 0


def test_list_filters_by_state_and_paginates(api):
    ids = [api.post("/v1/jobs", json=_with("name", f"j{i}")).json()["id"] for i in range(3)]
    api.post(f"/v1/jobs/{ids[0]}/cancel")
    assert {j["id"] for j in api.get("/v1/jobs?state=Pending").json()["items"]} == set(ids[1:])
    assert [j["id"] for j in api.get("/v1/jobs?state=Cancelled").json()["items"]] == [ids[0]]
    first = api.get("/v1/jobs?limit=2").json()
    second = api.get(f"/v1/jobs?limit=2&offset={first['next_offset']}").json()
    assert len(first["items"]) == 2 and len(second["items"]) == 1 and second["next_offset"] is None
    assert api.get("/v1/jobs?state=Done").status_code == 422


def test_cancel_then_cancel_again_is_409(api):
    alice = api.user_token("alice")
    job_id = api.post("/v1/jobs", json=SPEC, token=alice).json()["id"]
    cancelled = api.post(f"/v1/jobs/{job_id}/cancel", token=alice)
    assert cancelled.status_code == 200 and cancelled.json()["state"] == "Cancelled"
    assert "cancelled by" in cancelled.json()["reason"]
    again = api.post(f"/v1/jobs/{job_id}/cancel")
    assert again.status_code == 409 and "Cancelled" in again.json()["detail"]
    reasons = [e["reason"] for e in api.get(f"/v1/jobs/{job_id}/events").json()["items"]]
    assert reasons == ["Submitted", "Cancelled"]


def test_a_user_sees_and_cancels_only_their_own_jobs_and_an_admin_all(api):
    alice, bob = api.user_token("alice"), api.user_token("bob")
    alices = api.post("/v1/jobs", json=SPEC, token=alice).json()
    admins = api.post("/v1/jobs", json=SPEC).json()["id"]
    assert alices["owner"].startswith("tok-")  # her token: names are free text
    # bob cannot tell alice's job from a job that does not exist
    for path in ("", "/events", "/metrics", "/checkpoint"):
        hidden = api.get(f"/v1/jobs/{alices['id']}{path}", token=bob)
        assert hidden.status_code == 404 and "not found" in hidden.json()["detail"], path
    refused = api.post(f"/v1/jobs/{alices['id']}/cancel", token=bob)
    assert refused.status_code == 404
    assert api.post(f"/v1/jobs/{admins}/cancel", token=alice).status_code == 404
    assert [j["id"] for j in api.get("/v1/jobs", token=bob).json()["items"]] == []
    assert [j["id"] for j in api.get("/v1/jobs", token=alice).json()["items"]] == [alices["id"]]
    assert {j["id"] for j in api.get("/v1/jobs").json()["items"]} == {alices["id"], admins}
    assert api.get(f"/v1/jobs/{alices['id']}").json()["state"] == "Pending"  # nothing changed
    # another token given the same name is another user
    alice2 = api.user_token("alice")
    assert api.post(f"/v1/jobs/{alices['id']}/cancel", token=alice2).status_code == 404
    assert api.post(f"/v1/jobs/{alices['id']}/cancel", token=alice).json()["state"] == "Cancelled"
    assert api.post(f"/v1/jobs/{admins}/cancel").json()["state"] == "Cancelled"  # the admin may


def test_a_job_shows_which_device_owns_which_shards(api):
    a, b = api.register("a"), api.register("b")
    job_id = api.post("/v1/jobs", json=SPEC).json()["id"]
    with api.app.state.session_factory() as session, session.begin():
        for shard in range(16):
            owner = a if shard < 10 else b
            session.add(ShardAssignment(job_id=job_id, shard=shard, device_id=owner["device_id"],
                                        since_step=0, role="primary"))
        session.add(ShardAssignment(job_id=job_id, shard=3, device_id=b["device_id"],
                                    since_step=0, role="backup"))
    shown = api.get(f"/v1/jobs/{job_id}").json()
    assert shown["shards"] == {a["device_id"]: list(range(10)), b["device_id"]: list(range(10, 16))}
    assert sorted(shown["devices"]) == sorted([a["device_id"], b["device_id"]])
    listed = api.get("/v1/jobs").json()["items"][0]
    assert listed["shards"] == shown["shards"]


@pytest.mark.parametrize("suffix", ["", "/cancel", "/events", "/metrics", "/checkpoint"])
def test_unknown_job_ids_are_404(api, suffix):
    method = api.post if suffix == "/cancel" else api.get
    resp = method(f"/v1/jobs/job-missing{suffix}")
    assert resp.status_code == 404 and "job-missing" in resp.json()["detail"]


def test_get_shows_the_devices_holding_shards_and_the_metrics_curve(api):
    device = api.register()
    job_id = api.post("/v1/jobs", json=SPEC).json()["id"]
    with api.app.state.session_factory() as session, session.begin():
        session.add_all([ShardAssignment(job_id=job_id, shard=k, device_id=device["device_id"])
                         for k in range(3)])
        session.add_all([StepMetric(job_id=job_id, step=t, train_loss=2.0 - t / 10, samples=256)
                         for t in range(3)])
    assert api.get(f"/v1/jobs/{job_id}").json()["devices"] == [device["device_id"]]
    assert api.get("/v1/jobs").json()["items"][0]["devices"] == [device["device_id"]]
    curve = api.get(f"/v1/jobs/{job_id}/metrics").json()["items"]
    assert [p["train_loss"] for p in curve] == [2.0, 1.9, 1.8]
    assert [p["step"] for p in api.get(f"/v1/jobs/{job_id}/metrics?since_step=2").json()["items"]] == [2]


def test_checkpoint_is_404_until_one_is_recorded_then_streams_the_latest(api):
    job_id = api.post("/v1/jobs", json=SPEC).json()["id"]
    none_yet = api.get(f"/v1/jobs/{job_id}/checkpoint")
    assert none_yet.status_code == 404 and "no checkpoint yet" in none_yet.json()["detail"]
    folder = api.settings.data_dir / "checkpoints"
    folder.mkdir(parents=True)
    for step in (50, 100):
        buf = io.BytesIO()
        np.savez(buf, w=np.full(3, step, dtype=np.float32))
        (folder / f"{step}.npz").write_bytes(buf.getvalue())
        with api.app.state.session_factory() as session, session.begin():
            session.add(Checkpoint(job_id=job_id, step=step, path=f"checkpoints/{step}.npz",
                                   sha256="0" * 64, size_bytes=len(buf.getvalue())))
    resp = api.get(f"/v1/jobs/{job_id}/checkpoint")
    assert resp.status_code == 200 and resp.headers["x-phalanx-step"] == "100"
    with np.load(io.BytesIO(resp.content), allow_pickle=False) as arrays:
        assert arrays["w"].tolist() == [100.0] * 3


OWN_MODEL = {"layers": [{"type": "conv2d", "out_channels": 8}, {"type": "batchnorm"},
                        {"type": "relu"}, {"type": "maxpool"}, {"type": "flatten"},
                        {"type": "dense", "units": 10}]}


def test_a_users_own_layer_graph_is_accepted_as_custom_and_a_bad_one_names_its_layer(api):
    resp = api.post("/v1/jobs", json={**SPEC, "model": OWN_MODEL})
    assert resp.status_code == 201, resp.text
    job = resp.json()
    assert job["spec"]["model"]["arch"] == "custom"
    assert job["spec"]["model"]["layers"] == OWN_MODEL["layers"]
    assert job["plan"]["parameters"] == 8 * 9 + 8 + 16 + 8 * 4 * 4 * 10 + 10
    assert "layers" not in api.post("/v1/jobs", json=SPEC).json()["spec"]["model"]
    bad = {"layers": [*OWN_MODEL["layers"][:4], {"type": "dense", "units": 10}]}
    resp = api.post("/v1/jobs", json={**SPEC, "model": bad})
    assert resp.status_code == 422
    (err,) = resp.json()["detail"]
    assert err["field"] == "model"
    assert "model.layers[4] (dense): needs a flat input, got shape (8, 4, 4)" in err["msg"]
    both = api.post("/v1/jobs", json={**SPEC, "model": {**OWN_MODEL, "arch": "cnn"}})
    assert both.status_code == 422 and "either model.arch" in both.text
    assert api.count(Job) == 2


def test_a_dry_run_answers_the_plan_and_where_it_could_run_and_creates_nothing(api):
    for name, rack, ram_mb in (("roomy", "a", 8000), ("tiny", "a", 100),
                               ("elsewhere", "b", 8000)):  # agents of today (test_compute_class)
        api.heartbeat(api.register(name, labels={"rack": rack}, ram_mb=ram_mb),
                      {"telemetry": [], "capabilities": {"features": list(FEATURES),
                                                         "compute_class": compute_class()}})
    events = api.count(Event)
    resp = api.post("/v1/jobs?dry_run=true", json=SPEC)
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    assert api.count(Job) == 0 and api.count(Event) == events
    assert answer["state"] == "Pending" and answer["total_steps"] == 100
    plan = answer["plan"]
    assert plan["parameters"] == 53_002 and plan["micro_batch"] == 16
    # cnn on 8x8: conv1 is 32 x 8 x 8 outputs of 9 multiply-adds, forward + backward = 3 x 2
    conv1 = plan["layers"][0]
    assert conv1["path"] == "model.layers[0]" and conv1["out_shape"] == [32, 8, 8]
    assert conv1["flops_per_sample"] == 3 * 2 * 32 * 8 * 8 * 9
    assert plan["flops_per_sample"] == sum(layer["flops_per_sample"] for layer in plan["layers"])
    # 8 devices, 2 shards each: one pre-added partial up per device, not one per shard
    assert plan["bytes_per_step"] == 8 * plan["weights_bytes"] + 8 * plan["gradient_bytes"]
    assert 64 << 20 < plan["memory_per_device_bytes"] < 100 << 20
    # float16 uploads take no partials (their sums leave its range): one upload per shard
    half = api.post("/v1/jobs?dry_run=true", json={**SPEC, "upload_precision": "float16"})
    f16 = half.json()["plan"]
    assert f16["gradient_bytes"] < 0.51 * plan["gradient_bytes"]
    assert f16["bytes_per_step"] == 8 * f16["weights_bytes"] + 16 * f16["gradient_bytes"]
    placement = answer["placement"]
    assert placement["eligible"] == 1 and placement["ineligible"] == 2
    reasons = {d["reason"] for d in placement["ineligible_devices"]}
    assert any(r.startswith("too little memory (needs") for r in reasons), reasons
    assert "label rack!=a" in reasons


def test_a_job_no_phone_has_the_memory_for_is_refused_with_the_reason(api):
    api.register("small", ram_mb=100)
    api.register("smaller", ram_mb=90)
    resp = api.post("/v1/jobs", json=_with("placement.selector", {}))
    assert resp.status_code == 422
    (err,) = resp.json()["detail"]
    assert err["field"] == "model" and "the largest phone has 50 MiB usable" in err["msg"]
    assert api.count(Job) == 0
    api.register("big", ram_mb=4000)  # one phone that can hold it is enough
    resp = api.post("/v1/jobs", json=_with("placement.selector", {}))
    assert resp.status_code == 201, resp.text
    assert resp.json()["plan"]["memory_per_device_bytes"] > 50 << 20
