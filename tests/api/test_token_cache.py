"""docs/api.md: "Each API process caches a token lookup for up to 5 s: a revoked token stops
working at once on the process that revoked it and within 5 s on the others." Two control
planes on one database stand for two API processes; their token caches read a monotonic clock
the test moves by hand (api.auth reads `time.monotonic`), so nothing sleeps."""

from __future__ import annotations

import pytest

from api import auth
from domain.store.tokens import hash_token
from tests.api.conftest import api_on


class Monotonic:
    """`time` as api.auth sees it: a monotonic clock that moves when the test says."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Monotonic:
    fake = Monotonic()
    monkeypatch.setattr(auth, "time", fake)
    return fake


def test_a_revoked_token_stops_at_once_here_and_within_5_s_on_another_process(
        sqlite_url, tmp_path, clock: Monotonic) -> None:
    with api_on(sqlite_url, tmp_path / "a") as here, api_on(sqlite_url, tmp_path / "b") as there:
        made = here.post("/v1/tokens", json={"name": "alice"}).json()
        token = made["token"]
        assert there.get("/v1/jobs", token=token).status_code == 200  # cached there now
        assert here.delete(f"/v1/tokens/{made['id']}").status_code == 200
        refused = here.get("/v1/jobs", token=token)
        assert refused.status_code == 401 and refused.json() == {"detail": "bearer token revoked"}

        clock.now += 5 - 0.001  # the other process still has its lookup from before
        assert there.get("/v1/jobs", token=token).status_code == 200
        clock.now += 0.002  # just past 5 s since it looked the token up
        late = there.get("/v1/jobs", token=token)
        assert late.status_code == 401 and late.json() == {"detail": "bearer token revoked"}


def test_a_token_found_valid_is_looked_up_again_only_after_5_s(sqlite_url, tmp_path,
                                                               clock: Monotonic) -> None:
    """The cache's other side: a lookup is reused for up to 5 s, not longer (the revocation
    above depends on it), and a token not found is never cached (a new one works at once)."""
    with api_on(sqlite_url, tmp_path / "a") as here, api_on(sqlite_url, tmp_path / "b") as there:
        made = here.post("/v1/tokens", json={"name": "bob"}).json()
        secret_hash = hash_token(made["token"])
        there_auth: auth.Authenticator = there.app.state.authenticator
        assert there_auth.cached(made["token"])[1] is None  # never asked there: a miss
        assert there.get("/v1/jobs", token=made["token"]).status_code == 200
        assert there_auth.cache.get(secret_hash) is not None
        clock.now += 5
        assert there_auth.cache.get(secret_hash) is not None  # 5 s exactly: still the lookup
        clock.now += 0.001
        assert there_auth.cache.get(secret_hash) is None
