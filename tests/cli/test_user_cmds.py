"""Every user command against a live server, including what a user sees when it goes wrong."""

from __future__ import annotations

import hashlib
import json
import os
import re
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import yaml

from domain.store.db import make_engine, make_session_factory, transaction
from domain.store.lifecycle import quarantine
from domain.store.models import utcnow
from tests.cli.conftest import Cli, one_line_error
from tests.support.arrays import npz_bytes
from tests.support.waiting import wait_for

SMALL_JOB = {
    "name": "tiny-logreg",
    "model": {"arch": "logreg"},
    "dataset": "digits",
    "global_batch_size": 64,
    "shards": 4,
    "epochs": 1,
    "placement": {"selector": {"rack": "nowhere"}},  # stays Pending: nothing matches
}


def write_spec(tmp_path: Path, spec: dict[str, Any], name: str = "job.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(spec))
    return path


# -- login and where the server/token come from ------------------------------------------------

def test_login_saves_a_private_config_that_later_commands_use(cli: Cli) -> None:
    result = cli("login", "--server", cli.server.url, "--token", cli.server.admin_token,
                 server=None, token=None)
    assert result.exit_code == 0, result.output
    assert stat.S_IMODE(cli.config.stat().st_mode) == 0o600
    assert json.loads(cli.config.read_text()) == {
        "current-context": "default",
        "contexts": {"default": {"server": cli.server.url, "token": cli.server.admin_token}}}
    listed = cli("datasets", "ls", server=None, token=None)
    assert listed.exit_code == 0, listed.output
    assert "digits" in listed.stdout


def test_login_with_a_bad_token_fails_and_saves_nothing(cli: Cli) -> None:
    result = cli("login", "--server", cli.server.url, "--token", "phx-wrong", server=None,
                 token=None)
    line = one_line_error(result)
    assert "401" in line
    assert not cli.config.exists()


def test_flags_override_the_environment_which_overrides_the_config(cli: Cli) -> None:
    cli.config.parent.mkdir(parents=True)
    cli.config.write_text(json.dumps({"server": "http://127.0.0.1:9", "token": "stale"}))
    assert cli("jobs", "ls").exit_code == 0  # env (live server) beats the stale config
    flagged = cli("jobs", "ls", "--token", "phx-flag-wins")
    assert "401" in one_line_error(flagged)


def test_a_bad_token_is_one_clear_line_and_exit_1(cli: Cli) -> None:
    line = one_line_error(cli("devices", "ls", token="phx-not-a-token"))
    assert "401" in line


def test_an_unreachable_server_is_one_clear_line_and_exit_3(cli: Cli) -> None:
    line = one_line_error(cli("jobs", "ls", server="http://127.0.0.1:9"), code=3)
    assert "cannot reach http://127.0.0.1:9" in line


def test_no_server_configured_says_to_log_in_instead_of_trying_localhost(cli: Cli) -> None:
    line = one_line_error(cli("devices", "ls", server=None), code=2)
    assert "no server configured: run `phalanx login" in line


def test_version_flag_and_shell_completion(cli: Cli, monkeypatch: pytest.MonkeyPatch) -> None:
    import shellingham

    from phalanx import __version__

    assert cli("--version").stdout.strip() == __version__
    # typer finds the user's shell in the process tree (shellingham); the suite's tree is
    # whatever started it (nohup, timeout, CI), where detection fails: a user's bash here
    monkeypatch.setattr(shellingham, "detect_shell", lambda: ("bash", "/bin/bash"))
    script = cli("--show-completion")
    assert script.exit_code == 0 and "complete -o" in script.stdout, script.output


# -- tokens -------------------------------------------------------------------------------------

def test_user_token_works_for_jobs_but_not_for_admin_commands(cli: Cli) -> None:
    created = cli("tokens", "create", "--user", "--name", "alice")
    assert created.exit_code == 0, created.output
    user_token = created.stdout.strip()
    assert cli("jobs", "ls", token=user_token).exit_code == 0
    assert "403" in one_line_error(cli("tokens", "create", "--enroll", token=user_token))


def test_enrollment_token_enrolls_a_phone_with_its_labels(cli: Cli) -> None:
    created = cli("tokens", "create", "--enroll", "--label", "rack=b", "--max-uses", "1")
    assert created.exit_code == 0, created.output
    secret = created.stdout.strip()
    # the printed one-liner pins what this server serves: the script and the agent archive
    line = next(ln for ln in created.stderr.splitlines() if ln.startswith("curl "))
    served = {path: hashlib.sha256(httpx.get(f"{cli.server.url}{path}", timeout=30).content)
              .hexdigest() for path in ("/install.sh", "/agent.tar.gz")}
    assert f'echo "{served["/install.sh"]}  install.sh" | sha256sum -c' in line
    assert line.endswith(f"--server {cli.server.url} --token {secret} --sha256 "
                         f'{served["/agent.tar.gz"]}')
    body = {"enrollment_token": secret, "name": "p1", "labels": {}, "spec": {}}
    reply = httpx.post(f"{cli.server.url}/v1/devices/register", json=body, timeout=30)
    assert reply.status_code == 201, reply.text
    assert reply.json()["labels"]["rack"] == "b"
    again = httpx.post(f"{cli.server.url}/v1/devices/register", json=body, timeout=30)
    assert again.status_code == 403, again.text
    assert again.json() == {"detail": "enrollment token used up (1 uses)"}


def test_bad_label_flag_is_refused_before_any_request(cli: Cli) -> None:
    assert "key=value" in one_line_error(cli("tokens", "create", "--enroll", "--label", "oops"))


# -- devices ------------------------------------------------------------------------------------

def test_devices_ls_describe_and_the_admin_actions(
        cli: Cli, register_device: Callable[..., dict[str, Any]]) -> None:
    dev = register_device("rack-a-phone-7")
    dev_id = dev["device_id"]
    table = cli("devices", "ls")
    assert table.exit_code == 0, table.output
    assert "rack-a-phone-7" in table.stdout and dev_id in table.stdout
    assert dev_id in [d["id"] for d in cli.json("devices", "ls")]
    described = cli("devices", "describe", dev_id)
    assert described.exit_code == 0 and "SM-G975U" in described.stdout
    for action, state in (("cordon", "Cordoned"), ("uncordon", None), ("drain", "Draining")):
        result = cli("devices", action, dev_id)
        assert result.exit_code == 0, result.output
        shown = cli.json("devices", "describe", dev_id)
        if state:
            assert shown["state"] == state
        else:
            assert shown["state"] != "Cordoned" and not shown["cordoned"]
    removed = cli("devices", "rm", dev_id)
    assert removed.exit_code == 0 and "deleted" in removed.stdout
    assert dev_id not in [d["id"] for d in cli.json("devices", "ls")]


def test_describe_shows_a_quarantine_and_its_lift(
        cli: Cli, register_device: Callable[..., dict[str, Any]]) -> None:
    dev_id = register_device("rack-a-liar")["device_id"]
    reason = "result mismatch in job job-x at step 7: shards 0..2 (its sha256 1111 != 2222)"
    engine = make_engine(cli.server.env["PHALANX_DATABASE_URL"])
    try:
        with transaction(make_session_factory(engine)) as session:
            assert quarantine(session, dev_id, reason, utcnow(), job_id=None,
                              data={"step": 7, "node": [0, 2]})
    finally:
        engine.dispose()
    described = cli("devices", "describe", dev_id)
    assert described.exit_code == 0, described.output
    facts, events = described.stdout.split("\nEvents:\n")
    assert yaml.safe_load(facts)["quarantine_reason"] == reason
    assert re.search(r"Quarantined\s.*result mismatch in job job-x", events), events
    assert re.search(r"Quarantined\s.*result mismatch in job job-x", described.stdout)
    lifted = cli("devices", "uncordon", dev_id)
    assert lifted.exit_code == 0, lifted.output
    facts, events = cli("devices", "describe", dev_id).stdout.split("\nEvents:\n")
    assert yaml.safe_load(facts)["quarantine_reason"] is None
    assert re.search(r"QuarantineLifted\s", events), events


def test_unknown_device_is_one_line_naming_it(cli: Cli) -> None:
    for args in (("describe",), ("cordon",), ("drain",), ("rm",)):
        line = one_line_error(cli("devices", *args, "dev-doesnotexist"))
        assert "404" in line


# -- jobs -----------------------------------------------------------------------------------

def test_submit_ls_describe_events_cancel(cli: Cli, tmp_path: Path) -> None:
    submitted = cli("jobs", "submit", "-f", str(write_spec(tmp_path, SMALL_JOB)))
    assert submitted.exit_code == 0, submitted.output
    job_id = submitted.stdout.split()[0]
    assert job_id.startswith("job-")
    listed = cli("jobs", "ls")
    assert job_id in listed.stdout and "tiny-logreg" in listed.stdout
    job = cli.json("jobs", "describe", job_id)
    assert job["state"] == "Pending" and job["spec"]["model"]["arch"] == "logreg"
    assert cli("jobs", "describe", job_id).exit_code == 0
    table = cli("jobs", "events", job_id)
    assert table.exit_code == 0 and "Submitted" in table.stdout
    events = cli.json("jobs", "events", job_id)
    assert [e["reason"] for e in events] == ["Submitted"], events
    cancelled = cli("jobs", "cancel", job_id)
    assert cancelled.exit_code == 0 and "Cancelled" in cancelled.stdout
    assert cli.json("jobs", "describe", job_id)["state"] == "Cancelled"
    reasons = [e["reason"] for e in cli.json("jobs", "events", job_id)]
    assert reasons[0] == "Submitted" and reasons[-1] == "Cancelled", reasons
    assert "409" in one_line_error(cli("jobs", "cancel", job_id))
    watched = cli("jobs", "watch", job_id)
    assert watched.exit_code == 4 and "Cancelled" in watched.stdout  # 4: the job did not succeed
    events = cli.json("jobs", "events", job_id)
    assert any("ancel" in (e["reason"] + e["message"]) for e in events)


def test_a_json_spec_file_works_too(cli: Cli, tmp_path: Path) -> None:
    path = tmp_path / "job.json"
    path.write_text(json.dumps(SMALL_JOB))
    job = cli.json("jobs", "submit", "-f", str(path))
    assert job["name"] == "tiny-logreg" and job["state"] == "Pending"


def test_a_dry_run_prints_the_plan_and_submits_nothing(cli: Cli, tmp_path: Path) -> None:
    path = write_spec(tmp_path, SMALL_JOB)
    before = len(cli.json("jobs", "ls"))  # the server is shared with the other tests
    shown = cli("jobs", "submit", "-f", str(path), "--dry-run", "-o", "wide")
    assert shown.exit_code == 0, shown.output
    text = " ".join(re.sub(r"[^\x00-\x7f]", " ", shown.stdout).split())  # no table borders
    assert "parameters 650" in text  # 64 x 10 + 10 for logreg on 8x8 digits
    assert "memory per phone" in text and "total steps 22" in text
    assert "model.layers[1] dense 10 650" in text  # the layer table (-o wide)
    plan = cli.json("jobs", "submit", "-f", str(path), "--dry-run")["plan"]
    assert plan["flops_per_sample"] == 3 * (64 + 2 * 64 * 10)  # flatten + the dense layer
    assert "slices" not in text and plan["slices"] == 1
    sliced = write_spec(tmp_path, {**SMALL_JOB, "slices": 2}, "sliced.yaml")
    text = " ".join(re.sub(r"[^\x00-\x7f]", " ", cli(
        "jobs", "submit", "-f", str(sliced), "--dry-run").stdout).split())
    assert "slices 2 (the largest 640 parameters)" in text  # the kernel; the bias is the other
    too_many = cli("jobs", "submit", "-f", str(write_spec(tmp_path, {
        **SMALL_JOB, "slices": 3}, "many.yaml")), "--dry-run")
    assert too_many.exit_code != 0 and "exceeds this model's 2 parameter tensors" in (
        too_many.output + too_many.stderr)
    assert len(cli.json("jobs", "ls")) == before


def test_invalid_yaml_names_the_file_and_line(cli: Cli, tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("name: x\nmodel: {arch: cnn\ndataset: digits\n")
    line = one_line_error(cli("jobs", "submit", "-f", str(path)))
    assert "broken.yaml" in line and "line" in line


def test_yaml_that_is_not_a_mapping_is_refused(cli: Cli, tmp_path: Path) -> None:
    path = tmp_path / "list.yaml"
    path.write_text("- a\n- b\n")
    assert "mapping" in one_line_error(cli("jobs", "submit", "-f", str(path)))


def test_yaml_with_python_tags_is_refused_not_executed(cli: Cli, tmp_path: Path) -> None:
    path = tmp_path / "evil.yaml"
    path.write_text("name: !!python/object/apply:os.system ['touch pwned']\n")
    one_line_error(cli("jobs", "submit", "-f", str(path)))
    assert not Path("pwned").exists()


def test_a_spec_the_server_rejects_names_the_field(cli: Cli, tmp_path: Path) -> None:
    bad = dict(SMALL_JOB, shards=5)  # 64 is not divisible by 5
    line = one_line_error(cli("jobs", "submit", "-f", str(write_spec(tmp_path, bad))))
    assert "422" in line and "shards" in line
    typo = dict(SMALL_JOB, epochz=3)
    assert "epochz" in one_line_error(cli("jobs", "submit", "-f", str(write_spec(tmp_path, typo))))


def test_missing_spec_file_is_one_line(cli: Cli, tmp_path: Path) -> None:
    assert "cannot read" in one_line_error(cli("jobs", "submit", "-f", str(tmp_path / "no.yaml")))


def test_unknown_job_is_one_line_for_every_job_command(cli: Cli) -> None:
    for cmd in ("describe", "events", "cancel", "checkpoint", "watch"):
        assert "404" in one_line_error(cli("jobs", cmd, "job-doesnotexist")), cmd


def test_checkpoint_of_a_job_without_one_is_one_line(cli: Cli, tmp_path: Path) -> None:
    job = cli.json("jobs", "submit", "-f", str(write_spec(tmp_path, SMALL_JOB)))
    line = one_line_error(cli("jobs", "checkpoint", job["id"], "-O", str(tmp_path / "c.npz")))
    assert "404" in line and "has no checkpoint yet" in line, line
    assert not (tmp_path / "c.npz").exists()


# -- datasets -------------------------------------------------------------------------------

def test_datasets_ls_shows_digits_and_an_upload(cli: Cli, tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    path = tmp_path / "blobs.npz"
    path.write_bytes(npz_bytes(x=rng.normal(size=(120, 10)).astype(np.float32),
                         y=rng.integers(0, 3, size=120)))
    uploaded = cli("datasets", "upload", str(path))
    assert uploaded.exit_code == 0, uploaded.output
    names = {d["name"] for d in cli.json("datasets", "ls")}
    assert {"digits", "blobs"} <= names
    table = cli("datasets", "ls")
    assert "blobs" in table.stdout and "digits" in table.stdout


def test_upload_errors_are_one_line(cli: Cli, tmp_path: Path) -> None:
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip file")
    assert "junk.npz" in one_line_error(cli("datasets", "upload", str(junk)))
    no_y = tmp_path / "no_y.npz"
    no_y.write_bytes(npz_bytes(x=np.zeros((4, 2), np.float32)))
    assert "y" in one_line_error(cli("datasets", "upload", str(no_y)))
    bad_name = tmp_path / "ok.npz"
    bad_name.write_bytes(npz_bytes(x=np.zeros((4, 2), np.float32), y=np.zeros(4, np.int64)))
    assert "422" in one_line_error(cli("datasets", "upload", str(bad_name), "--name", "no spaces!"))


def test_watch_follows_a_job_to_success_and_checkpoint_downloads_its_weights(
        cli: Cli, tmp_path: Path) -> None:
    """Light simulated phones (`phalanx sim --job`) train a small job while the CLI watches."""
    import threading

    from phalanx.sim.fleet import FleetOptions, run_fleet

    job = dict(SMALL_JOB, name="watched", placement={"selector": {"pool": "watch"}})
    submitted = cli.json("jobs", "submit", "-f", str(write_spec(tmp_path, job)))
    fleet = threading.Thread(target=run_fleet, args=(FleetOptions(
        server=cli.server.url, phones=3, duration_s=120, interval_s=1, compute=True,
        admin_token=cli.server.admin_token, labels={"pool": "watch"},
        follow_job=submitted["id"]),), daemon=True)
    fleet.start()
    watched = cli("jobs", "watch", submitted["id"])
    assert watched.exit_code == 0, watched.output
    assert "Succeeded" in watched.stdout and "val accuracy" in watched.stdout
    out = tmp_path / "weights.npz"
    got = cli("jobs", "checkpoint", submitted["id"], "-O", str(out))
    assert got.exit_code == 0, got.output
    with np.load(out, allow_pickle=False) as npz:
        assert npz.files and str(out) in got.stdout
    assert cli.json("jobs", "describe", submitted["id"])["state"] == "Succeeded"
    fleet.join(timeout=60)  # it stops by itself once the job has ended
    assert not fleet.is_alive()
    check_report_in_a_browser(cli, submitted["id"], tmp_path)


def check_report_in_a_browser(cli: Cli, job_id: str, tmp_path: Path) -> None:
    """The job's page opens offline in a real browser without complaint, and its curves hold
    the job's points."""
    from tests.support.browser import console_errors, render

    page = tmp_path / "report.html"
    written = cli("jobs", "report", job_id, "-O", str(page))
    assert written.exit_code == 0, written.output
    html = page.read_text()
    assert "<script" not in html and "http://" not in html and "https://" not in html
    shown = render(page, tmp_path, screenshot=tmp_path / "report.png")
    assert console_errors(shown.log) == [], shown.log[-3000:]
    with cli.server.client() as c:
        curve = c.get(f"/v1/jobs/{job_id}/metrics").json()["items"]
    losses = [m for m in curve if m["train_loss"] is not None]
    assert losses
    found = re.search(r'data-series="train" data-points="(\d+)"', shown.dom)
    assert found and int(found.group(1)) == len(losses), shown.dom[:2000]
    assert 'aria-label="timeline"' in shown.dom and "data-device=" in shown.dom
    assert (tmp_path / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the server's own pages, as a logged-in browser gets them, rendered the same way
    with httpx.Client(base_url=cli.server.url) as browser:
        assert browser.post("/ui/login", data={"token": cli.server.admin_token}).status_code == 303
        for name, path in (("ui-fleet.html", "/ui"), ("ui-job.html", f"/ui/jobs/{job_id}")):
            got = browser.get(path)
            assert got.status_code == 200 and "<script" not in got.text
            (tmp_path / name).write_text(got.text)
            shown = render(tmp_path / name, tmp_path)
            assert console_errors(shown.log) == [], shown.log[-3000:]
            assert job_id in shown.dom
    fleet_dom = render(tmp_path / "ui-fleet.html", tmp_path).dom
    with cli.server.client() as c:
        fleet = c.get("/v1/devices").json()["items"]
    assert fleet_dom.count("<tr data-device=") == len(fleet)


def test_reads_filter_on_the_server_and_print_yaml_and_wide(cli: Cli, register_device,
                                                            tmp_path: Path) -> None:
    register_device("rack-a-1", {"row": "a", "zone": "1"})  # (the enrollment says rack=a)
    register_device("rack-b-1", {"row": "b", "zone": "1"})
    register_device("spare", {"spare": "yes"})

    def names(*args: str) -> list[str]:
        return sorted(d["name"] for d in cli.json("devices", "ls", *args)
                      if d["name"] in ("rack-a-1", "rack-b-1", "spare"))

    assert names("-l", "row=a") == ["rack-a-1"]
    assert names("-l", "row!=a") == ["rack-b-1", "spare"]
    assert names("-l", "row in (a,b),zone=1") == ["rack-a-1", "rack-b-1"]
    assert names("-l", "!row") == ["spare"]
    assert names("--state", "Ready", "-l", "zone") == ["rack-a-1", "rack-b-1"]
    assert "selector" in one_line_error(cli("devices", "ls", "-l", "row=~a"))
    listed = yaml.safe_load(cli("devices", "ls", "-l", "spare", "-o", "yaml").stdout)
    assert [d["name"] for d in listed] == ["spare"] and listed[0]["labels"] == {"rack": "a", "spare": "yes"}
    wide = cli("devices", "ls", "-l", "row=a", "-o", "wide").stdout
    assert "LABELS" in wide and "rack=a,row=a,zone=1" in wide
    pending = cli.json("jobs", "submit", "-f", str(write_spec(tmp_path, SMALL_JOB)))
    assert pending["id"] in {j["id"] for j in cli.json("jobs", "ls", "--state", "Pending")}
    assert pending["id"] not in {j["id"] for j in cli.json("jobs", "ls", "--state", "Running")}
    assert "PRIORITY" in cli("jobs", "ls", "-o", "wide").stdout


def test_a_phones_compute_class_in_the_wide_list_and_describe_and_a_jobs_exactness(
        cli: Cli, register_device, tmp_path: Path) -> None:
    facts = {"machine": "x86_64", "numpy": "2.4.6",
             "blas": {"library": "openblas", "version": "0.3.31.188.0", "kernel": "SkylakeX"},
             "simd": "X86_V4", "simd_features": 42, "fingerprint": "be23673d0b4b503b"}
    phone = register_device("classy", {"cc": "yes"})
    beat = httpx.post(f"{cli.server.url}/v1/devices/{phone['device_id']}/heartbeat",
                      json={"telemetry": [], "capabilities": {"compute_class": facts}},
                      headers={"Authorization": f"Bearer {phone['device_token']}"}, timeout=30)
    assert beat.status_code == 200, beat.text
    register_device("classless", {"cc": "yes"})
    wide = cli("devices", "ls", "-l", "cc", "-o", "wide").stdout
    assert "COMPUTE CLASS" in wide and "COMPUTE CLASS" not in cli("devices", "ls").stdout
    (row,) = [line for line in wide.splitlines() if "classy" in line]
    assert "x86_64 openblas SkylakeX X86_V4 #be23673d" in row
    described = cli("devices", "describe", phone["device_id"]).stdout
    assert "fingerprint: be23673d0b4b503b" in described and "version: 0.3.31.188.0" in described
    job = cli.json("jobs", "submit", "-f", str(write_spec(tmp_path, {**SMALL_JOB,
                                                                     "exactness": "class"})))
    assert "exactness: class" in cli("jobs", "describe", job["id"]).stdout
    (line,) = [ln for ln in cli("jobs", "ls", "-o", "wide").stdout.splitlines() if job["id"] in ln]
    assert " class " in line
    here = {**SMALL_JOB, "exactness": "class", "placement": {"selector": {"cc": "yes"}}}
    plan = cli("jobs", "submit", "-f", str(write_spec(tmp_path, here)), "--dry-run").stdout
    assert re.search(r"exactness +class", plan) and "x86_64 openblas SkylakeX X86_V4 #be23673d: 1 device(s)" in plan
    cli("jobs", "cancel", job["id"])


def test_piped_tables_keep_each_row_on_one_line(cli: Cli, register_device) -> None:
    """`phalanx devices ls -o wide | grep ...`: the real process, its stdout a pipe, a narrow
    COLUMNS; rich would wrap the table to it and cut the labels a script greps for."""
    labels = {"building": "north-annex", "shelf": "rack-17-slot-42", "owner": "vision-lab"}
    register_device("piped-row-phone", labels)
    env = {**os.environ, "PHALANX_SERVER": cli.server.url, "PHALANX_TOKEN": cli.server.admin_token,
           "PHALANX_CONFIG": str(cli.config), "COLUMNS": "60"}
    run = subprocess.run([sys.executable, "-m", "phalanx.cli.main", "devices", "ls", "-o", "wide",
                          "-l", "owner=vision-lab"], env=env, capture_output=True, text=True,
                         timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    row = [line for line in run.stdout.splitlines() if "piped-row-phone" in line]
    assert len(row) == 1, run.stdout
    assert "building=north-annex,owner=vision-lab,rack=a,shelf=rack-17-slot-42" in row[0]


def test_tokens_are_listed_without_secrets_and_revoked(cli: Cli) -> None:
    secret = cli("tokens", "create", "--user", "--name", "bob").stdout.strip()
    listed = cli.json("tokens", "ls")
    bob = next(t for t in listed if t["name"] == "bob")
    assert bob["kind"] == "user" and not bob["revoked"] and secret not in json.dumps(listed)
    assert "bob" in cli("tokens", "ls").stdout
    assert cli("tokens", "revoke", bob["id"]).exit_code == 0
    assert next(t for t in cli.json("tokens", "ls") if t["id"] == bob["id"])["revoked"]
    assert "401" in one_line_error(cli("jobs", "ls", token=secret))
    cli("tokens", "create", "--enroll", "--name", "rack c")
    enrollments = cli.json("tokens", "ls", "--enroll")
    rack_c = next(t for t in enrollments if t.get("description") == "rack c")
    assert cli("tokens", "revoke", rack_c["id"]).exit_code == 0
    assert next(t for t in cli.json("tokens", "ls", "--enroll")
                if t["id"] == rack_c["id"])["revoked"]


def test_devices_label_describe_and_a_watched_list(cli: Cli, register_device,
                                                   monkeypatch) -> None:
    device_id = register_device("labelled", {"row": "1", "spare": "yes"})["device_id"]
    done = cli("devices", "label", device_id, "row=2", "spare-")
    assert done.exit_code == 0, done.output
    assert "rack=a,row=2" in done.stdout
    described = cli("devices", "describe", device_id)
    assert "Relabeled" in described.stdout and "row=2, spare-" in described.stdout
    # -w: a new document each time the list changes, until Ctrl-C
    from phalanx.cli import user_cmds

    naps = []

    def nap(_: float) -> None:
        naps.append(1)
        if len(naps) == 1:
            register_device("newcomer", {"row": "9"})
        else:
            raise KeyboardInterrupt

    monkeypatch.setattr(user_cmds.time, "sleep", nap)
    watched = cli("devices", "ls", "-l", "row in (2,9)", "-w", "-o", "json")
    assert watched.exit_code == 0, watched.output
    docs = [json.loads(d) for d in watched.stdout.replace("]\n[", "]\x00[").split("\x00")]
    assert [[d["name"] for d in doc] for doc in docs] == [["labelled"], ["labelled", "newcomer"]]


def test_job_events_follow_until_the_job_ends(cli: Cli, tmp_path: Path, monkeypatch) -> None:
    job_id = cli.json("jobs", "submit", "-f", str(write_spec(tmp_path, SMALL_JOB)))["id"]
    from phalanx.cli import user_cmds

    def nap(_: float) -> None:  # the job is cancelled while the command follows it
        with cli.server.client() as admin:
            admin.post(f"/v1/jobs/{job_id}/cancel")

    monkeypatch.setattr(user_cmds.time, "sleep", nap)
    followed = cli("jobs", "events", job_id, "-f")
    assert followed.exit_code == 0, followed.output
    assert "Submitted" in followed.stdout and "Cancelled" in followed.stdout


def test_contexts_like_kubeconfig(cli: Cli) -> None:
    cli.config.parent.mkdir(parents=True, exist_ok=True)
    cli.config.write_text(json.dumps({"server": cli.server.url, "token": cli.server.admin_token}))
    assert cli("jobs", "ls", server=None, token=None).exit_code == 0  # a file from before: "default"
    done = cli("login", "--server", "http://127.0.0.1:9", "--token", "t", "--no-verify",
               "--context", "far", server=None, token=None)
    assert done.exit_code == 0, done.output
    assert stat.S_IMODE(cli.config.stat().st_mode) == 0o600
    contexts = cli.json("config", "get-contexts", server=None, token=None)
    assert [(c["name"], c["current"]) for c in contexts] == [("default", False), ("far", True)]
    assert "t" not in json.dumps(contexts).replace('"', " ").split()  # no token shown
    assert one_line_error(cli("jobs", "ls", server=None, token=None), code=3)  # far is down
    near = cli("jobs", "ls", server=None, token=None, env={"PHALANX_CONTEXT": "default"})
    assert near.exit_code == 0, near.output
    assert cli("config", "use-context", "default", server=None, token=None).exit_code == 0
    assert cli("jobs", "ls", server=None, token=None).exit_code == 0
    assert "no context 'moon'" in one_line_error(cli("config", "use-context", "moon"))


def test_devices_logs_prints_what_the_agent_ships_and_says_when_nothing_comes(
        cli: Cli, register_device) -> None:
    """The phone side is played here over HTTP as the agent does it (its ring and the
    heartbeat command are tested with the real agent in tests/agent/test_against_server.py)."""
    import threading
    import time as clock

    device = register_device("phone-logs")
    dev_id, token = device["device_id"], device["device_token"]
    lines = [{"seq": i, "ts": 1_765_000_000.0 + i, "level": "WARNING" if i == 2 else "INFO",
              "message": f"agent.runtime.work: step {i} done"} for i in (1, 2, 3)]

    def phone() -> None:
        headers = {"Authorization": f"Bearer {token}"}
        for _ in range(100):
            beat = httpx.post(f"{cli.server.url}/v1/devices/{dev_id}/heartbeat",
                              json={"telemetry": []}, headers=headers, timeout=30)
            if {"type": "logs"} in beat.json().get("commands", []):
                httpx.post(f"{cli.server.url}/v1/devices/{dev_id}/logs", json={"lines": lines},
                           headers=headers, timeout=30)
                return
            clock.sleep(0.2)

    playing = threading.Thread(target=phone, daemon=True)
    playing.start()
    shown = cli("devices", "logs", dev_id, "--timeout", "30")
    playing.join(timeout=30)
    assert shown.exit_code == 0, shown.output
    printed = shown.stdout.strip().splitlines()
    assert printed[1] == "2025-12-06 05:46:42 WARNING agent.runtime.work: step 2 done"
    assert len(printed) == 3
    silent = register_device("phone-silent")["device_id"]
    line = one_line_error(cli("devices", "logs", silent, "--timeout", "1"))
    assert f"device {silent} sent no logs within 1 s: is it online?" in line


def test_agents_rollout_status_and_stop(cli: Cli, register_device) -> None:
    phone = register_device("old-agent", {"rollout": "cli"})
    try:
        refused = one_line_error(cli("agents", "rollout", "--version", "9.9.9"))
        assert "serves agent" in refused and "9.9.9" in refused
        started = cli.json("agents", "rollout", "--max-parallel", "3")
        assert started["active"] and started["max_parallel"] == 3
        served = started["served"]["version"]
        assert started["version"] == served
        beat = httpx.post(f"{cli.server.url}/v1/devices/{phone['device_id']}/heartbeat",
                          headers={"Authorization": f"Bearer {phone['device_token']}"},
                          json={"telemetry": [], "agent_version": "0.0.1",
                                "capabilities": {"features": ["self_upgrade"]}}, timeout=30)
        assert beat.status_code == 200, beat.text

        def told() -> bool:
            wide = cli("devices", "ls", "-l", "rollout=cli", "-o", "wide").stdout
            return f"0.0.1 → {served}" in wide

        wait_for("the scheduler tells the old agent to upgrade", told, timeout=60)
        status = cli("agents", "status")
        assert status.exit_code == 0 and f"rollout of agent {served}" in status.stdout
        assert cli.json("agents", "status")["devices"]["upgrading"] >= 1
    finally:
        stopped = cli("agents", "stop")
    assert stopped.exit_code == 0 and "rollout stopped" in stopped.stdout
    assert "no rollout" in stopped.stdout
    wait_for("the upgrade is called off", lambda: "→" not in cli(
        "devices", "ls", "-l", "rollout=cli", "-o", "wide").stdout, timeout=60)
