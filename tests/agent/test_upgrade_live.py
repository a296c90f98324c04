"""Phones that upgrade themselves, end to end: a real server serving another agent build, real
agents started by launch.sh under a runit-like loop (restart whenever it exits, stay down on
exit 3). A rollout upgrades the phones one at a time between jobs; a build that cannot start
is rolled back on the phone, reported, and not asked for again."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from agent.slots import Slots
from tests.agent import live
from tests.agent.builds import agent_tree
from tests.agent.test_slots import install_launcher
from tests.support.databases import migrated_sqlite
from tests.support.env import ADMIN_TOKEN, without_settings
from tests.support.server import LiveServer, start_server, stop_process

RUNIT_LIKE = 'while :; do sh "$0" run --config "$1"; [ $? = 3 ] && exit 3; sleep 0.2; done'


def serving(tmp_path: Path, version: str, *, broken: bool = False) -> LiveServer:
    """A server whose /agent.tar.gz is the checkout's agent at `version`."""
    tree = agent_tree(tmp_path / "served", version, broken=broken)
    return start_server(database_url=migrated_sqlite(tmp_path / "phalanx.sqlite"),
                        data_dir=tmp_path / "data", admin_token=ADMIN_TOKEN,
                        extra_env=live.SERVER_ENV, cwd=tree)


def pin_release_key(server: LiveServer, home: Path) -> str:
    """The server's release key, pinned in the agent home: these phones run the checkout's
    agent, which (not installed from the server's archive) carries no key of its own, and
    over plain http an agent without one refuses every upgrade (agent/release.py)."""
    with server.client() as c:
        key = c.get("/v1/agent/release-key").json()["public_key"]
    (home / "release_key").write_text(key + "\n")
    return key


def supervised(p: live.Phone, home: Path, *, pin: bool = True) -> subprocess.Popen[bytes]:
    install_launcher(home)
    if pin:
        pin_release_key(p.server, home)
    env = without_settings() | {"PHALANX_AGENT_HOME": str(home), "PYTHONUNBUFFERED": "1",
                                "PHALANX_AGENT_PYTHON": sys.executable,
                                "PHALANX_SYSFS_ROOT": str(p.root)}
    env.pop("PYTHONPATH", None)
    with p.log.open("ab") as log:
        return subprocess.Popen(["sh", "-c", RUNIT_LIKE, str(home / "launch.sh"), str(p.config)],
                                env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def reasons(p: live.Phone, *wanted: str) -> list[dict[str, Any]]:
    return [e for e in p.events() if e["reason"] in wanted]


def rollout(server: LiveServer, **body: Any) -> Any:
    with server.client() as c:
        return c.put("/v1/agent/rollout", json=body)


def test_a_rollout_upgrades_phones_one_at_a_time(tmp_path: Path, cool_phone: Path) -> None:
    server = serving(tmp_path, "0.2.0")
    phones = [live.enroll(server, tmp_path, cool_phone) for _ in range(2)]
    loops = [supervised(p, tmp_path / f"agent-home-{i}") for i, p in enumerate(phones)]
    try:
        for p in phones:
            p.wait("the old agent heartbeats", lambda p=p: p.device()["agent_version"] == "0.1.0")
        refused = rollout(server, version="9.9.9")
        assert refused.status_code == 409 and "serves agent 0.2.0" in refused.text
        started = rollout(server, version="0.2.0", max_parallel=1)
        assert started.status_code == 200, started.text
        assert started.json()["served"]["version"] == "0.2.0"
        for p in phones:
            p.wait("the phone runs 0.2.0", lambda p=p: p.device()["agent_version"] == "0.2.0"
                   and p.device()["upgrade_to"] is None, timeout=120)
        spans = []
        for p in phones:
            begun, = reasons(p, "AgentUpgradeStarted")
            done, = reasons(p, "AgentUpgraded")
            assert begun["message"] == "agent 0.1.0 -> 0.2.0"
            spans.append((begun["ts"], done["ts"]))
        spans.sort()
        assert spans[0][1] <= spans[1][0], f"two phones upgraded at once: {spans}"
        for i in range(2):
            assert not Slots(tmp_path / f"agent-home-{i}").in_trial  # kept: it heartbeated
        with server.client() as c:
            status = c.get("/v1/agent/rollout").json()
        assert status["devices"] == {"up_to_date": 2, "upgrading": 0, "failed": 0,
                                     "waiting": 0, "cannot": 0}
    finally:
        for loop in loops:
            stop_process(loop, group=True)
        server.stop()


def test_a_build_that_cannot_start_is_rolled_back_and_not_asked_again(
        tmp_path: Path, cool_phone: Path) -> None:
    server = serving(tmp_path, "0.2.0", broken=True)
    p = live.enroll(server, tmp_path, cool_phone)
    home = tmp_path / "agent-home"
    loop = supervised(p, home)
    try:
        p.wait("the old agent heartbeats", lambda: p.device()["agent_version"] == "0.1.0")
        assert rollout(server, max_parallel=5).status_code == 200
        p.wait("the phone reports the rollback",
               lambda: p.device()["upgrade_failed"] == "0.2.0", timeout=120)
        failed, = reasons(p, "AgentUpgradeFailed")
        assert failed["message"].startswith("rolled_back: agent 0.2.0:"), failed
        assert "launch.sh: agent slot 0.2.0-" in p.log.read_text()
        p.wait("the old agent runs again", lambda: p.device()["agent_version"] == "0.1.0"
               and p.device()["state"] == "Ready" and p.device()["upgrade_to"] is None)
        time.sleep(4 * float(live.SERVER_ENV["PHALANX_RECONCILE_INTERVAL_S"]))  # more passes
        with server.client() as c:
            status = c.get("/v1/agent/rollout").json()
        assert status["devices"]["failed"] == 1
        assert len(reasons(p, "AgentUpgradeStarted")) == 1  # never asked again
        assert Slots(home).current == ""
    finally:
        stop_process(loop, group=True)
        server.stop()
