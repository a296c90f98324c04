"""Upgrades no network can forge (issue 42, item 9). Over plain http the `upgrade` command and
the archive come from whoever is on the path; the agent installs only a build signed by a
release key it trusts (agent/release.py), and an agent holding no key upgrades only over https.

The phone's network is a fake transport here (`Network`): it answers what the server, or
someone between, sends. The agents are real (agent.runtime.upgrader with real slots)."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import logging
import subprocess
import sys
import tarfile
import threading
from pathlib import Path
from typing import Any

import pytest

from agent import ed25519, release
from agent.client import Client
from agent.runtime.upgrader import Upgrader
from agent.slots import Slots
from api.agent_dist import ReleaseKey, build_archive
from tests.agent.builds import agent_tree
from tests.agent.helpers import REPO
from tests.support.env import without_settings

SERVER_KEY = ReleaseKey.from_seed(hashlib.sha256(b"the control plane").digest())
ATTACKER_KEY = ReleaseKey.from_seed(hashlib.sha256(b"someone on the path").digest())
PAYLOAD = "open('/tmp/phalanx-owned', 'w').write('owned')  # the attacker's code\n"


def build(tmp_path: Path, version: str, key: ReleaseKey | None = SERVER_KEY,
          payload: str = "") -> bytes:
    tree = agent_tree(tmp_path / f"src-{version}-{len(payload)}-{key is None}", version)
    if payload:
        main = tree / "agent" / "__main__.py"
        main.write_text(payload + main.read_text())
    return build_archive({"agent": tree / "agent", "engine": REPO / "engine",
                          "wire": REPO / "wire"}, version, key.public if key else None)


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def tampered(archive: bytes, payload: str = PAYLOAD) -> bytes:
    """The archive with the attacker's code put in front of `python -m agent`, the rest as
    it was (same names, same version, same key file)."""
    src = tarfile.open(fileobj=io.BytesIO(gzip.decompress(archive)))
    raw = io.BytesIO()
    with src, tarfile.open(fileobj=raw, mode="w", format=tarfile.PAX_FORMAT) as out:
        for member in src.getmembers():
            data = src.extractfile(member).read() if member.isfile() else b""
            if member.name.endswith("/agent/__main__.py"):
                data = payload.encode() + data
                member.size = len(data)
            out.addfile(member, io.BytesIO(data))
    return gzip.compress(raw.getvalue(), mtime=0)


class Network:
    """What answers the phone: the archive (with the headers it comes with) and the
    upgrade reports, all recorded."""

    def __init__(self, archive: bytes, headers: dict[str, str] | None = None) -> None:
        self.archive, self.headers = archive, headers or {}
        self.requests: list[tuple[str, str]] = []

    def __call__(self, method: str, url: str, headers: dict[str, str], body: Any,
                 timeout_s: float, max_bytes: int) -> tuple[int, dict[str, str], bytes]:
        self.requests.append((method, url))
        if url.endswith("/agent.tar.gz"):
            return 200, {"Content-Type": "application/gzip", **self.headers}, self.archive
        return 404, {"Content-Type": "application/json"}, b'{"detail": "not here"}'

    @property
    def downloads(self) -> int:
        return sum(url.endswith("/agent.tar.gz") for _, url in self.requests)


def signed_headers(key: ReleaseKey, version: str, archive: bytes) -> dict[str, str]:
    return {release.SIGNATURE_HEADER: key.sign(version, sha(archive)),
            release.KEY_HEADER: key.public.hex()}


def phone(tmp_path: Path, network: Network, *, pin: ReleaseKey | None = SERVER_KEY,
          server: str = "http://control-plane:8000") -> tuple[Upgrader, Slots]:
    """An agent started by launch.sh (it has slots) whose home pins `pin`: the checkout's
    agent carries no key of its own."""
    home = tmp_path / "agent-home"
    home.mkdir(parents=True, exist_ok=True)
    if pin is not None:
        (home / "release_key").write_text(pin.public.hex() + "\n")
    slots = Slots(home)
    return Upgrader(Client(server, "phx-dev-phone", transport=network), "dev-1", slots,
                    busy=lambda: False), slots


def command(version: str, archive: bytes) -> dict[str, Any]:
    return {"type": "upgrade", "version": version, "sha256": sha(archive), "url": "/agent.tar.gz"}


def test_a_genuine_signed_build_is_installed(tmp_path: Path) -> None:
    genuine = build(tmp_path, "0.2.0")
    network = Network(genuine, signed_headers(SERVER_KEY, "0.2.0", genuine))
    up, slots = phone(tmp_path, network)
    stop = threading.Event()
    up.handle(command("0.2.0", genuine), stop)
    assert slots.current == f"0.2.0-{sha(genuine)[:8]}" and stop.is_set()
    assert up.reports == []
    # the slot holds the server's key: the new agent trusts it for the next upgrade
    installed = slots.home / "slots" / slots.current / "agent" / release.KEY_FILE
    assert release.trusted_keys(None, installed) == [SERVER_KEY.public]


@pytest.mark.parametrize("signer", [None, ATTACKER_KEY], ids=["unsigned", "attackers-key"])
def test_a_forged_upgrade_command_is_refused(tmp_path: Path, signer, caplog) -> None:
    """Someone on the network path answers a heartbeat with an `upgrade` command for their
    own build and serves it at /agent.tar.gz, its hash matching the command: unsigned, or
    signed with their own key (the key file inside their archive names it, too)."""
    evil = build(tmp_path, "6.6.6", key=signer or ATTACKER_KEY, payload=PAYLOAD)
    network = Network(evil, signed_headers(signer, "6.6.6", evil) if signer else {})
    up, slots = phone(tmp_path, network)
    stop = threading.Event()
    with caplog.at_level(logging.ERROR):
        up.handle(command("6.6.6", evil), stop)
    assert slots.current == "" and not stop.is_set(), "the forged build was installed"
    assert not (slots.home / "slots").exists() or not any((slots.home / "slots").iterdir())
    (version, outcome, detail), = up.reports
    assert (version, outcome) == ("6.6.6", "failed")
    assert ("without a release signature" in detail if signer is None
            else "not signed by a release key this agent trusts" in detail), detail
    assert release.fingerprint(SERVER_KEY.public) in detail or signer is None
    # asked again by the next heartbeat: refused without another download
    up.handle(command("6.6.6", evil), stop)
    assert network.downloads == 1 and slots.current == ""


def test_a_tampered_archive_is_refused(tmp_path: Path) -> None:
    """The server's genuine build and signature, the archive changed on the way, and the
    command's hash rewritten to match it (both come over the same plain http)."""
    genuine = build(tmp_path, "0.2.0")
    evil = tampered(genuine)
    assert evil != genuine
    network = Network(evil, signed_headers(SERVER_KEY, "0.2.0", genuine))
    up, slots = phone(tmp_path, network)
    stop = threading.Event()
    up.handle(command("0.2.0", evil), stop)
    assert slots.current == "" and not stop.is_set(), "the tampered build was installed"
    (version, outcome, detail), = up.reports
    assert (version, outcome) == ("0.2.0", "failed")
    assert "not signed by a release key this agent trusts" in detail
    # the same tampered bytes under the genuine command: another build, not now (as a
    # replica mid-deploy); nothing installed, nothing reported
    up2, slots2 = phone(tmp_path / "second", Network(evil, signed_headers(
        SERVER_KEY, "0.2.0", genuine)))
    up2.handle(command("0.2.0", genuine), stop)
    assert slots2.current == "" and up2.reports == [] and not stop.is_set()


def test_a_signature_binds_the_version_too(tmp_path: Path) -> None:
    """A genuine build and its signature under another version name (a downgrade or a
    version the rollout never named) is refused: the name is signed with the hash."""
    genuine = build(tmp_path, "0.2.0")
    network = Network(genuine, signed_headers(SERVER_KEY, "0.2.0", genuine))
    up, slots = phone(tmp_path, network)
    up.handle(command("0.3.0", genuine), threading.Event())
    assert slots.current == ""
    (version, outcome, detail), = up.reports
    assert version == "0.3.0" and "not signed" in detail


def test_an_agent_without_a_key_upgrades_over_https_only(tmp_path: Path) -> None:
    # the checkout's agent carries no key: keys come from the server's archive or a pin
    assert not release.packaged_key_path().exists()
    genuine = build(tmp_path, "0.2.0", key=None)
    plain = Network(genuine)
    up, slots = phone(tmp_path, plain, pin=None)
    stop = threading.Event()
    up.handle(command("0.2.0", genuine), stop)
    assert slots.current == "" and not stop.is_set()
    assert plain.downloads == 0  # refused before anything was fetched
    (version, outcome, detail), = up.reports
    assert outcome == "failed" and "no release key" in detail and "plain http" in detail
    # over https the server's certificate authenticates the build (as before)
    tls = Network(genuine)
    up, slots = phone(tmp_path / "tls", tls, pin=None, server="https://control-plane:8443")
    up.handle(command("0.2.0", genuine), stop)
    assert slots.current.startswith("0.2.0-") and stop.is_set()


def test_ed25519_agrees_with_rfc_8032() -> None:
    """RFC 8032 section 7.1, tests 1-3: key, signature and verification, byte for byte."""
    vectors = [
        ("9d61b19deffd5a60ba844af492ec2cc44449c5697b326919703bac031cae7f60",
         "d75a980182b10ab7d54bfed3c964073a0ee172f3daa62325af021a68f707511a", "",
         "e5564300c360ac729086e2cc806e828a84877f1eb8e5d974d873e065224901555fb8821590a33bacc6"
         "1e39701cf9b46bd25bf5f0595bbe24655141438e7a100b"),
        ("4ccd089b28ff96da9db6c346ec114e0f5b8a319f35aba624da8cf6ed4fb8a6fb",
         "3d4017c3e843895a92b70aa74d1b7ebc9c982ccf2ec4968cc0cd55f12af4660c", "72",
         "92a009a9f0d4cab8720e820b5f642540a2b27b5416503f8fb3762223ebdb69da085ac1e43e15996e45"
         "8f3613d0f11d8c387b2eaeb4302aeeb00d291612bb0c00"),
        ("c5aa8df43f9f837bedb7442f31dcb7b166d38535076f094b85ce3a2e0b4458f7",
         "fc51cd8e6218a1a38da47ed00230f0580816ed13ba3303ac5deb911548908025", "af82",
         "6291d657deec24024827e69c3abe01a30ce548a284743a445e3680d7db5ac3ac18ff9b538d16f290ae"
         "67f760984dc6594a7c15e9716ed28dc027beceea1ec40a"),
    ]
    for seed, public, message, signature in vectors:
        seed_b, pub_b, msg_b, sig_b = map(bytes.fromhex, (seed, public, message, signature))
        assert ed25519.public_key(seed_b) == pub_b
        assert ed25519.sign(seed_b, msg_b) == sig_b
        assert ed25519.verify(pub_b, msg_b, sig_b)
        assert not ed25519.verify(pub_b, msg_b + b"\0", sig_b)
        for i in (0, 31, 32, 63):  # a flipped bit in R or in S
            bad = bytearray(sig_b)
            bad[i] ^= 1
            assert not ed25519.verify(pub_b, msg_b, bytes(bad))
        # S + L: the same point, a non-canonical S, refused (no malleability)
        s = int.from_bytes(sig_b[32:], "little") + ed25519.L
        assert not ed25519.verify(pub_b, msg_b, sig_b[:32] + s.to_bytes(32, "little"))
    assert not ed25519.verify(b"\0" * 31, b"", b"\0" * 64)
    assert not ed25519.verify(bytes.fromhex(vectors[0][1]), b"", b"\0" * 63)


def test_a_key_can_be_pinned_on_a_phone_installed_otherwise(tmp_path: Path) -> None:
    home = tmp_path / "home"
    env = without_settings() | {"PYTHONPATH": str(REPO), "PHALANX_AGENT_HOME": str(home)}

    def agent(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "agent", *args], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=60)

    bad = agent("install-launcher", "--home", str(home), "--release-key", "abc")
    assert bad.returncode == 2 and "64 hex digits" in bad.stderr
    done = agent("install-launcher", "--home", str(home), "--release-key",
                 SERVER_KEY.public.hex().upper())
    assert done.returncode == 0, done.stderr
    assert (home / "release_key").read_text().strip() == SERVER_KEY.public.hex()
    assert release.trusted_keys(home) == [SERVER_KEY.public]
    probe = agent("probe")
    assert probe.returncode == 0, probe.stderr
    assert json.loads(probe.stdout)["release_keys"] == [release.fingerprint(SERVER_KEY.public)]
