"""`phalanx datasets rm` and `share` (issue 42, item 5): a user's upload is theirs until an
admin shares it; its owner removes it."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.cli.conftest import Cli, one_line_error
from tests.support.arrays import npz_bytes


def _user(cli: Cli, name: str) -> str:
    with cli.server.client() as admin:
        resp = admin.post("/v1/tokens", json={"name": name})
        assert resp.status_code == 201, resp.text
        return resp.json()["token"]


def test_an_upload_is_its_owners_until_an_admin_shares_it(cli: Cli, tmp_path: Path) -> None:
    alice, bob = _user(cli, "alice"), _user(cli, "bob")
    rng = np.random.default_rng(0)
    path = tmp_path / "alices-data.npz"
    path.write_bytes(npz_bytes(x=rng.normal(size=(60, 6)).astype(np.float32),
                               y=np.arange(60) % 3))
    uploaded = cli("datasets", "upload", str(path), token=alice)
    assert uploaded.exit_code == 0, uploaded.output

    def names(token: str) -> set[str]:
        return {d["name"] for d in cli.json("datasets", "ls", token=token)}

    assert "alices-data" in names(alice) and "alices-data" not in names(bob)
    line = one_line_error(cli("datasets", "rm", "alices-data", token=bob))
    assert "404" in line and "not found" in line, line
    line = one_line_error(cli("datasets", "share", "alices-data", token=alice))
    assert "403" in line and "admin" in line, line

    shared = cli("datasets", "share", "alices-data")  # the admin's token
    assert shared.exit_code == 0 and "shared with every user" in shared.stdout, shared.output
    assert "alices-data" in names(bob)
    row = next(r for r in cli("datasets", "ls", token=bob).stdout.splitlines()
               if "alices-data" in r)
    assert row.replace("│", " ").split()[-1] == "yes"
    line = one_line_error(cli("datasets", "rm", "alices-data", token=bob))
    assert "403" in line and "not yours" in line, line
    assert cli("datasets", "share", "alices-data", "--unshare").exit_code == 0
    assert "alices-data" not in names(bob)

    removed = cli("datasets", "rm", "alices-data", token=alice)
    assert removed.exit_code == 0 and "dataset alices-data removed" in removed.stdout
    assert "alices-data" not in names(alice)
    assert "404" in one_line_error(cli("datasets", "rm", "alices-data", token=alice))
