"""Device reads and the admin's lifecycle actions, with the events they record."""

from __future__ import annotations

import pytest

from domain.store.models import Device, Event
from domain.store.selectors import matches, parse_selector


def _reasons(api, device_id: str) -> list[str]:
    return [e["reason"] for e in api.get(f"/v1/devices/{device_id}/events").json()["items"]]


def test_list_filters_by_state_and_label_selector(api):
    a = api.register("a", {"rack": "a", "zone": "1"})
    api.register("b", {"rack": "a", "zone": "2"})
    api.register("c", {"rack": "b", "zone": "1"})
    api.post(f"/v1/devices/{a['device_id']}/cordon")

    def names(query: str) -> list[str]:
        resp = api.get(f"/v1/devices{query}")
        assert resp.status_code == 200, resp.text
        return [d["name"] for d in resp.json()["items"]]

    assert names("") == ["a", "b", "c"]
    assert names("?selector=rack=a") == ["a", "b"]
    assert names("?selector=rack=a,zone=1") == ["a"]
    assert names("?state=Ready") == ["b", "c"]
    assert names("?state=Cordoned,NotReady") == ["a"]
    assert names("?selector=rack=z") == []



@pytest.mark.parametrize("selector, wanted", [
    ("rack!=a", ["c", "d"]),  # as in Kubernetes: no label is not rack a
    ("rack==a", ["a", "b"]), ("zone in (1, 3)", ["a", "c"]), ("rack notin (a,b)", ["d"]),
    ("zone", ["a", "b", "c"]), ("!zone", ["d"]), ("rack=a,zone!=1", ["b"]),
    ("rack in (a,b),!spare,zone notin (2)", ["a", "c"]),
])
def test_label_selectors_read_as_kubernetes_writes_them(api, selector, wanted):
    for name, labels in (("a", {"rack": "a", "zone": "1"}), ("b", {"rack": "a", "zone": "2"}),
                         ("c", {"rack": "b", "zone": "1"}), ("d", {})):
        api.register(name, labels)
    listed = api.get("/v1/devices", params={"selector": selector})
    assert listed.status_code == 200, listed.text
    assert [d["name"] for d in listed.json()["items"]] == wanted
    every = [(d["name"], d["labels"]) for d in api.get("/v1/devices").json()["items"]]
    # the pure rule says the same as the SQL
    assert [n for n, labels in every if matches(parse_selector(selector), labels)] == wanted


def test_pagination_walks_every_device_once(api):
    for i in range(5):
        api.register(f"p{i}")
    seen, offset = [], 0
    while offset is not None:
        page = api.get(f"/v1/devices?limit=2&offset={offset}").json()
        seen += [d["name"] for d in page["items"]]
        offset = page["next_offset"]
    assert seen == [f"p{i}" for i in range(5)]


@pytest.mark.parametrize("query, field", [("?state=Sleeping", "state"), ("?selector=rack=~a", "selector"),
                                          ("?selector=rack in a", "selector"), ("?selector=,", "selector"),
                                          ("?limit=0", "limit"), ("?limit=x", "limit"),
                                          ("?offset=-1", "offset")])
def test_bad_list_queries_are_422(api, query, field):
    resp = api.get(f"/v1/devices{query}")
    assert resp.status_code == 422 and field in [e["field"] for e in resp.json()["detail"]]
    assert all(e["loc"][0] == "query" for e in resp.json()["detail"]), resp.json()


def test_get_shows_spec_labels_and_latest_telemetry(api):
    device = api.register("p", {"rack": "a"})
    api.heartbeat(device, {"telemetry": [{"ts": 100.0, "battery_pct": 50},
                                         {"ts": 200.0, "battery_pct": 49, "charging": True}]})
    shown = api.get(f"/v1/devices/{device['device_id']}").json()
    assert shown["labels"] == {"rack": "a"} and shown["spec"]["model"] == "SM-G975F"
    assert shown["latest_telemetry"] == {"ts": 200.0, "battery_pct": 49.0, "charging": True}


def test_cordon_drain_uncordon_change_state_and_record_events(api):
    device = api.register()
    dev_id = device["device_id"]
    assert api.post(f"/v1/devices/{dev_id}/cordon").json()["state"] == "Cordoned"
    assert api.post(f"/v1/devices/{dev_id}/cordon").json()["state"] == "Cordoned"  # no-op
    assert api.heartbeat(device).json()["commands"] == []
    drained = api.post(f"/v1/devices/{dev_id}/drain").json()
    assert drained["state"] == "Draining" and drained["cordoned"] is True
    assert api.heartbeat(device).json()["commands"] == [{"type": "drain"}]
    assert api.heartbeat(device).json()["state"] == "Draining"
    back = api.post(f"/v1/devices/{dev_id}/uncordon").json()
    assert back["state"] == "Ready" and not back["draining"]
    assert api.heartbeat(device).json()["commands"] == []
    assert _reasons(api, dev_id) == ["Registered", "Cordoned", "Draining", "Uncordoned"]


def test_delete_revokes_the_device_token(api):
    device = api.register()
    assert api.heartbeat(device).status_code == 200  # its token is now cached
    assert api.delete(f"/v1/devices/{device['device_id']}").status_code == 200
    assert api.heartbeat(device).status_code == 401
    assert api.get(f"/v1/devices/{device['device_id']}").status_code == 404
    assert api.count(Device) == 0


@pytest.mark.parametrize("method, suffix", [("get", ""), ("post", "/cordon"), ("post", "/uncordon"),
                                            ("post", "/drain"), ("delete", ""), ("get", "/events"),
                                            ("get", "/telemetry")])
def test_unknown_device_ids_are_404(api, method, suffix):
    events = api.count(Event)
    resp = getattr(api, method)(f"/v1/devices/dev-missing{suffix}")
    assert resp.status_code == 404 and "dev-missing" in resp.json()["detail"]
    assert api.count(Event) == events


def test_telemetry_history_since(api):
    device = api.register()
    api.heartbeat(device, {"telemetry": [{"ts": t, "power_w": t / 100} for t in (100.0, 200.0)]})
    api.heartbeat(device, {"telemetry": [{"ts": 300.0, "power_w": 3.0}]})
    history = api.get(f"/v1/devices/{device['device_id']}/telemetry").json()["items"]
    assert [s["power_w"] for s in history] == [1.0, 2.0, 3.0]
    since = api.get(f"/v1/devices/{device['device_id']}/telemetry",
                    params={"since": "1970-01-01T00:03:20Z"}).json()["items"]
    assert [s["power_w"] for s in since] == [2.0, 3.0]
    assert api.get(f"/v1/devices/{device['device_id']}/telemetry?since=yesterday").status_code == 422


def test_an_admin_sets_and_removes_labels_with_a_merge_patch(api):
    device = api.register("p", {"rack": "a", "spare": "yes"})
    path = f"/v1/devices/{device['device_id']}"
    patched = api.client.patch(path, json={"labels": {"rack": "b", "spare": None, "row": "3"}},
                               headers=api.headers())
    assert patched.status_code == 200, patched.text
    assert patched.json()["labels"] == {"rack": "b", "row": "3"}
    assert api.get("/v1/devices", params={"selector": "rack=b,!spare"}).json()["items"]
    events = api.get(f"{path}/events").json()["items"]
    relabeled = [e for e in events if e["reason"] == "Relabeled"]
    assert len(relabeled) == 1 and relabeled[0]["message"] == "rack=b, row=3, spare-"
    again = api.client.patch(path, json={"labels": {"rack": "b"}}, headers=api.headers())
    assert again.status_code == 200 and len([e for e in api.get(f"{path}/events").json()["items"]
                                             if e["reason"] == "Relabeled"]) == 1  # no change
    bad = api.client.patch(path, json={"labels": {"bad key!": "x"}}, headers=api.headers())
    assert bad.status_code == 422 and "label key" in bad.text
    user = api.client.patch(path, json={"labels": {"rack": "c"}},
                            headers=api.headers(api.user_token()))
    assert user.status_code == 403
    assert api.get(path).json()["labels"] == {"rack": "b", "row": "3"}


def test_logs_are_asked_for_in_the_heartbeat_shipped_by_the_device_and_read_by_the_admin(api):
    device = api.register("phone-logs")
    dev_id = device["device_id"]
    assert not [c for c in api.heartbeat(device).json()["commands"] if c["type"] == "logs"]
    asked = api.post(f"/v1/devices/{dev_id}/logs/request")
    assert asked.status_code == 202 and asked.json()["requested_at"] is not None
    for _ in range(2):  # every heartbeat asks until the lines arrive
        assert {"type": "logs"} in api.heartbeat(device).json()["commands"]
    lines = [{"seq": i, "ts": 1_765_000_000.0 + i, "level": "INFO", "message": f"line {i}"}
             for i in range(1, 4)]
    shipped = api.post(f"/v1/devices/{dev_id}/logs", token=device["device_token"],
                       json={"lines": lines})
    assert shipped.status_code == 200, shipped.text
    got = api.get(f"/v1/devices/{dev_id}/logs").json()
    assert got["requested_at"] is None and got["shipped_at"] is not None
    assert [line["message"] for line in got["lines"]] == ["line 1", "line 2", "line 3"]
    assert not [c for c in api.heartbeat(device).json()["commands"] if c["type"] == "logs"]
    too_many = api.post(f"/v1/devices/{dev_id}/logs", token=device["device_token"],
                        json={"lines": [lines[0]] * 1001})
    assert too_many.status_code == 422, too_many.text  # docs/api.md: "≤ 1000 lines"
    assert [e["field"] for e in too_many.json()["detail"]] == ["lines"]
