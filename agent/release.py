"""Signed agent releases: an upgrade no network can forge.

The control plane holds an Ed25519 key (`api.agent_dist`). It signs each build it serves:
the signature covers `release_message(version, sha256)` and travels with the archive
(`GET /agent.tar.gz`, header `X-Phalanx-Release-Signature`). Its public half travels inside
the archive, as `agent/release_key.json`: a phone installed with the install line got it
under the line's `--sha256`, and every upgrade it installs afterwards was signed by a key it
already trusted, so the chain starts at the install line and no heartbeat or download can
bend it.

Before an upgrade the agent checks, in this order: the archive is the one the heartbeat named
(sha256; another build from a replica mid-deploy is "not now"), then a key it trusts signed
that version and hash. Keys it trusts: the one in its own package and one an operator pinned
in `$PHALANX_AGENT_HOME/release_key` (hex; upgrades never replace that file). An agent with
neither upgrades only over https (the server's certificate is then what authenticates the
build); over plain http it refuses, whatever the command says.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from pathlib import Path

from agent import ed25519
from agent.slots import NotNow, UpgradeError

log = logging.getLogger(__name__)

KEY_FILE = "release_key.json"  # in the agent package, written by the server into its archive
PINNED_FILE = "release_key"  # in the agent home: an operator's pin, never replaced by upgrades
SIGNATURE_HEADER = "X-Phalanx-Release-Signature"
KEY_HEADER = "X-Phalanx-Release-Key"
ALGORITHM = "ed25519"
CONTEXT = "phalanx-agent-release/1"
HEX_KEY = re.compile(r"^[0-9a-f]{64}$")
HEX_SIGNATURE = re.compile(r"^[0-9a-f]{128}$")
HEX_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def release_message(version: str, sha256: str) -> bytes:
    """What a release signature covers: the build's name and its archive's hash, in a
    context of their own (a signature made for anything else never passes for this)."""
    return json.dumps({"context": CONTEXT, "version": version, "sha256": sha256.lower()},
                      sort_keys=True, separators=(",", ":")).encode()


def key_document(public: bytes) -> bytes:
    """`agent/release_key.json`: the public key a phone trusts for the builds it installs."""
    return (json.dumps({"algorithm": ALGORITHM, "public_key": public.hex()}, indent=2,
                       sort_keys=True) + "\n").encode()


def parse_key(text: str) -> bytes:
    """A public key from `release_key.json` or from a pin (64 hex digits)."""
    text = text.strip()
    if text.startswith("{"):
        doc = json.loads(text)
        if not isinstance(doc, dict) or doc.get("algorithm") != ALGORITHM:
            raise ValueError(f"not an {ALGORITHM} key document")
        text = str(doc.get("public_key", ""))
    text = text.lower()
    if not HEX_KEY.match(text):
        raise ValueError("an Ed25519 public key is 64 hex digits")
    return bytes.fromhex(text)


def fingerprint(public: bytes) -> str:
    """A short name for a key, for logs and operators: 16 hex digits of its sha256."""
    return hashlib.sha256(public).hexdigest()[:16]


def packaged_key_path() -> Path:
    return Path(__file__).resolve().with_name(KEY_FILE)


def trusted_keys(home: Path | None, packaged: Path | None = None) -> list[bytes]:
    """The release keys this agent trusts: its package's (the server that built it put it
    there) and the pin in its home, if any. A file that cannot be read is logged and skipped:
    with no key left, upgrades need https."""
    keys: list[bytes] = []
    for path in (packaged or packaged_key_path(), home / PINNED_FILE if home else None):
        if path is None:
            continue
        try:
            key = parse_key(path.read_text())
        except FileNotFoundError:
            continue
        except (OSError, ValueError) as exc:
            log.error("release key %s unusable (%s): not trusted", path, exc)
            continue
        if key not in keys:
            keys.append(key)
    return keys


def check(archive: bytes, signature: str | None, version: str, sha256: str,
          keys: list[bytes]) -> bytes:
    """Raise unless `archive` is the build the command named and one of `keys` signed it;
    returns the key that did. NotNow: another build (a replica mid-deploy), asked again;
    UpgradeError: not signed by a trusted key (forged, tampered, or a server with another
    key), reported."""
    got = hashlib.sha256(archive).hexdigest()
    if got != sha256.lower():
        raise NotNow(f"archive has sha256 {got}, not the {sha256} the rollout pins "
                     "(a replica serving another build, mid-deploy?)")
    if not signature:
        raise UpgradeError(f"the server sent agent {version} without a release signature "
                           f"({SIGNATURE_HEADER}): not installed")
    signature = signature.strip().lower()
    if not HEX_SIGNATURE.match(signature):
        raise UpgradeError(f"the release signature of agent {version} is not 128 hex digits")
    message = release_message(version, got)
    for key in keys:
        if ed25519.verify(key, message, bytes.fromhex(signature)):
            return key
    names = ", ".join(fingerprint(k) for k in keys)
    raise UpgradeError(f"agent {version} (sha256 {got[:16]}...) is not signed by a release "
                       f"key this agent trusts ({names}): forged or tampered on the way, or "
                       "a server with another key; not installed")
