"""The config file: 0600, atomic, and a damaged one gives a clear message, not a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agent.config import AgentConfig, ConfigError, load, save
from agent.runtime.ledger import UploadLedger
from tests.agent.helpers import REPO


def cfg() -> AgentConfig:
    return AgentConfig(server="http://127.0.0.1:1", device_id="dev-1", device_token="secret")


def test_the_config_is_written_0600_in_a_private_folder(tmp_path: Path) -> None:
    path = tmp_path / "cfg" / "config.json"
    save(path, cfg())
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert os.stat(path.parent).st_mode & 0o777 == 0o700
    assert load(path).device_token == "secret"


def test_a_rewrite_replaces_the_file_whole_and_cleans_a_killed_writers_temp(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    save(path, cfg())
    stale = tmp_path / ".config.json.dead.tmp"
    stale.write_text('{"server": "http://x", "dev')  # what a kill mid-write leaves
    other = tmp_path / ".other.json.alive.tmp"  # another agent's write in flight: not ours
    other.write_text("{}")
    again = cfg()
    again.device_id = "dev-2"
    save(path, again)
    assert load(path).device_id == "dev-2"
    assert not stale.exists() and other.exists()


@pytest.mark.parametrize("content", ['{"server": "http://x", "dev', "[]", "", '{"server": ""}',
                                     '{"server": "http://x"}'])
def test_a_damaged_config_is_a_config_error(tmp_path: Path, content: str) -> None:
    path = tmp_path / "config.json"
    path.write_text(content)
    with pytest.raises(ConfigError):
        load(path)


def test_unknown_keys_from_a_newer_agent_are_ignored(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    data = json.loads(cfg().to_json()) | {"from_the_future": 1}
    path.write_text(json.dumps(data))
    assert load(path).device_id == "dev-1"


@pytest.mark.parametrize("content", [None, '{"server": "http://x", "dev'])
def test_run_without_a_usable_config_says_what_to_do(tmp_path: Path, content: str | None) -> None:
    path = tmp_path / "config.json"
    if content is not None:
        path.write_text(content)
    out = subprocess.run([sys.executable, "-m", "agent", "run", "--config", str(path)],
                         cwd=REPO, capture_output=True, text=True, timeout=60,
                         env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert out.returncode == 2
    assert "phalanx-agent enroll" in out.stderr
    assert "Traceback" not in out.stderr


def test_the_upload_ledger_survives_a_torn_line_and_compacts(tmp_path: Path) -> None:
    path = tmp_path / "uploads.jsonl"
    ledger = UploadLedger(path)
    ledger.record("job-a", 0, [0, 1])
    ledger.record("job-a", 1, [0])
    with path.open("a") as fh:
        fh.write('{"job": "job-a", "st')  # killed mid-append
    again = UploadLedger(path)
    assert again.uploaded("job-a", 1, 0)
    assert not again.uploaded("job-a", 0, 0)  # an older step can never be offered again
    again.record("job-a", 1, [1])
    assert UploadLedger(path).uploaded("job-a", 1, 1)  # the torn tail did not eat the record
