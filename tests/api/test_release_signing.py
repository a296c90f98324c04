"""The control plane signs the agent builds it serves (issue 42, item 9): its release key is
made once in the data folder (private, shared by every replica on it), its public half is
inside the archive (pinned by the install line's sha256), and each build's signature goes
out with the archive; the rollout pins what phones then verify."""

from __future__ import annotations

import hashlib
import io
import json
import stat
import tarfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from agent import release
from api import agent_dist
from tests.api.conftest import api_on


def members(archive: bytes) -> dict[str, bytes]:
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        return {m.name.split("/", 1)[1]: tar.extractfile(m).read()
                for m in tar.getmembers() if m.isfile()}


def test_the_served_archive_carries_the_key_and_its_signature(api) -> None:
    resp = api.client.get("/agent.tar.gz")
    assert resp.status_code == 200
    archive = resp.content
    files = members(archive)
    key = release.parse_key(files[f"agent/{release.KEY_FILE}"].decode())
    assert resp.headers[release.KEY_HEADER] == key.hex()
    version = json.loads(api.get("/v1/agent/rollout").text)["served"]["version"]
    # what an agent checks: this very archive, this version, signed by the key it carries
    assert release.check(archive, resp.headers[release.SIGNATURE_HEADER], version,
                         hashlib.sha256(archive).hexdigest(), [key]) == key
    # the key's private half stays in the data folder, readable by its owner only
    path = api.settings.data_dir / agent_dist.KEY_FILE
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.read_text().strip() not in resp.text
    shown = api.get("/v1/agent/release-key").json()
    assert shown == {"algorithm": "ed25519", "public_key": key.hex(),
                     "fingerprint": release.fingerprint(key)}
    # a 304 still names the signature (a cache in between keeps the body)
    again = api.client.get("/agent.tar.gz", headers={"If-None-Match": resp.headers["etag"]})
    assert again.status_code == 304
    assert again.headers[release.SIGNATURE_HEADER] == resp.headers[release.SIGNATURE_HEADER]
    # the rollout pins the signed build
    started = api.client.put("/v1/agent/rollout", headers=api.headers(), json={})
    assert started.status_code == 200, started.text
    assert started.json()["sha256"] == hashlib.sha256(archive).hexdigest()


def test_replicas_on_one_data_folder_serve_the_same_signed_build(
        api, db_url: str, tmp_path: Path) -> None:
    """A second server on the same data folder (a replica, or the same one restarted) has
    the same key, so the same bytes: the hash a rollout pins holds on every replica."""
    first = api.client.get("/agent.tar.gz")
    agent_dist._served.cache_clear()  # as a fresh process would: the key read from the file
    with api_on(db_url, tmp_path) as replica:  # the same database and data folder
        assert replica.settings.data_dir == api.settings.data_dir
        second = replica.client.get("/agent.tar.gz")
    assert second.content == first.content
    assert second.headers[release.SIGNATURE_HEADER] == first.headers[release.SIGNATURE_HEADER]


def test_replicas_starting_together_make_one_key(tmp_path: Path) -> None:
    with ThreadPoolExecutor(8) as pool:
        keys = list(pool.map(lambda _: agent_dist.load_release_key(tmp_path / "data"),
                             range(8)))
    assert len({k.public for k in keys}) == 1
    assert [p.name for p in (tmp_path / "data").iterdir()] == [agent_dist.KEY_FILE]


def test_a_damaged_key_file_is_refused_not_replaced(tmp_path: Path) -> None:
    (tmp_path / agent_dist.KEY_FILE).write_text("not a key\n")
    with pytest.raises(ValueError, match="64 hex digits"):
        agent_dist.load_release_key(tmp_path)
    assert (tmp_path / agent_dist.KEY_FILE).read_text() == "not a key\n"
