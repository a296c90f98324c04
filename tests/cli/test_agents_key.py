"""`phalanx agents key`: the key the server signs agent builds with, as one line to pin on a
phone that did not come from the server's archive (issue 42, item 9)."""

from __future__ import annotations

import hashlib
import io
import tarfile

import httpx

from agent import release


def test_agents_key_prints_the_key_inside_the_served_archive(cli) -> None:
    archive = httpx.get(f"{cli.server.url}/agent.tar.gz", timeout=30).content
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        doc, = (tar.extractfile(m).read() for m in tar.getmembers()
                if m.name.endswith(f"/agent/{release.KEY_FILE}"))
    key = release.parse_key(doc.decode())
    shown = cli("agents", "key")
    assert shown.exit_code == 0, shown.output
    assert shown.stdout.strip() == (f"ed25519 {key.hex()}  (fingerprint "
                                    f"{hashlib.sha256(key).hexdigest()[:16]})")
    assert cli.json("agents", "key")["public_key"] == key.hex()
    # an unknown token is refused
    assert cli("agents", "key", token="phx-usr-nobody").exit_code != 0
