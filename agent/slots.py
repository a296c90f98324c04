"""Agent builds side by side, for upgrades that can be undone.

    $PHALANX_AGENT_HOME/            (default ~/.local/share/phalanx-agent, set by launch.sh)
      launch.sh                     what runit runs: picks the slot, rolls back (never upgraded)
      slots/<version>-<sha8>/       an unpacked agent archive: agent/, engine/, wire/
      current                       the slot launch.sh runs ("" or absent: the pip-installed agent)
      previous                      the slot to go back to
      trial                         present while `current` is new: the starts it has had
      rolled_back                   written by launch.sh: the slot it gave up on, for the agent
                                    to report

An upgrade unpacks the archive into a new slot (after checking its SHA-256 and every member's
path), points `previous` at the running slot and `current` at the new one, starts a trial and
exits; runit starts launch.sh again. The new agent ends the trial after its first heartbeat
(`confirm`): it can reach the server, so it stays. One that exits before that three times is
rolled back by launch.sh, which the agent can never break: an upgrade does not replace it.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import shutil
import tarfile
import tempfile
from pathlib import Path

HOME_ENV = "PHALANX_AGENT_HOME"
DEFAULT_HOME = "~/.local/share/phalanx-agent"  # launch.sh and install.sh say it in shell too
PACKAGES = ("agent", "engine", "wire")
SLOT_NAME = re.compile(r"^[A-Za-z0-9._+-]{1,80}$")
VERSION_LINE = re.compile(r'^__version__ = "([^"]+)"$', re.M)
MAX_ARCHIVE_BYTES = 64 * 1024 * 1024
MAX_UNPACKED_BYTES = 256 * 1024 * 1024


class UpgradeError(Exception):
    """The build cannot be installed; the message says why (reported to the server)."""


class NotNow(Exception):
    """This build could not be installed this time (another build served by the replica that
    answered, a full disk): asked again with the next heartbeat, not reported."""


def slot_name(version: str, sha256: str) -> str:
    name = f"{version}-{sha256[:8]}"
    if not SLOT_NAME.match(name):
        raise UpgradeError(f"version {version!r} cannot name a folder")
    return name


class Slots:
    def __init__(self, home: Path) -> None:
        self.home = home

    @classmethod
    def from_env(cls) -> Slots | None:
        """The slots of an agent started by launch.sh; None for one started otherwise (it
        cannot upgrade itself: nothing would start the new build, or roll it back)."""
        home = os.environ.get(HOME_ENV)
        return cls(Path(home)) if home else None

    # -- the small files launch.sh reads --------------------------------------------------
    def _read(self, name: str) -> str | None:
        try:
            return (self.home / name).read_text().strip()
        except FileNotFoundError:
            return None

    def _write(self, name: str, text: str) -> None:
        """Atomically: launch.sh may run after any crash."""
        tmp = self.home / f".{name}.tmp"
        tmp.write_text(text + "\n")
        os.replace(tmp, self.home / name)

    @property
    def current(self) -> str:
        return self._read("current") or ""

    @property
    def in_trial(self) -> bool:
        return (self.home / "trial").exists()

    # -- upgrade ---------------------------------------------------------------------------
    def install(self, archive: bytes, sha256: str, version: str) -> str:
        """Unpack a checked archive into its slot and make it the next one launch.sh starts,
        on trial. Returns the slot's name."""
        if len(archive) > MAX_ARCHIVE_BYTES:
            raise UpgradeError(f"archive of {len(archive):,} bytes is over the "
                               f"{MAX_ARCHIVE_BYTES:,} an agent accepts")
        got = hashlib.sha256(archive).hexdigest()
        if got != sha256:
            raise NotNow(f"archive has sha256 {got}, not the {sha256} the rollout pins "
                         "(a replica serving another build, mid-deploy?)")
        name = slot_name(version, sha256)
        slots = self.home / "slots"
        slots.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".unpack-", dir=slots))
        try:
            found = unpack(archive, staging)
            if found != version:
                raise UpgradeError(f"archive holds agent {found}, not {version}")
            target = slots / name
            if target.exists():
                shutil.rmtree(target)
            os.replace(staging, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        self._write("previous", self.current)
        self._write("trial", "0")
        self._write("current", name)
        self.prune(keep={name, self._read("previous") or ""})
        return name

    def confirm(self, running_version: str) -> bool:
        """End the trial: the new build reached the server. Whether there was one to end."""
        if not self.in_trial or not self.current.startswith(f"{running_version}-"):
            return False
        (self.home / "trial").unlink(missing_ok=True)
        return True

    def rolled_back(self) -> str | None:
        """The slot launch.sh gave up on, until `reported`."""
        return self._read("rolled_back") or None

    def reported(self) -> None:
        (self.home / "rolled_back").unlink(missing_ok=True)

    def reset(self) -> None:
        """Back to the installed agent: what a fresh install.sh means."""
        for name in ("current", "previous", "trial", "rolled_back"):
            (self.home / name).unlink(missing_ok=True)

    def prune(self, keep: set[str]) -> None:
        """Drop the slots neither current nor previous (a phone's storage is small)."""
        for path in (self.home / "slots").iterdir():
            if path.is_dir() and path.name not in keep and not path.name.startswith("."):
                shutil.rmtree(path, ignore_errors=True)


def unpack(archive: bytes, dest: Path) -> str:
    """The archive's packages (agent, engine, wire) into `dest`; returns the agent's version.
    Only regular files and folders under the archive's one top folder; nothing that would land
    outside `dest`, no links, no device files; a bounded total size."""
    total = 0
    try:
        with tarfile.open(fileobj=io.BytesIO(archive), mode="r:gz") as tar:
            members = tar.getmembers()
            tops = {m.name.split("/", 1)[0] for m in members}
            if len(tops) != 1:
                raise UpgradeError(f"archive has {len(tops)} top folders, not one")
            for member in members:
                parts = member.name.split("/")[1:]
                if not parts or parts[0] not in PACKAGES:
                    continue  # pyproject.toml: for pip, not needed to run
                if any(p in ("", ".", "..") for p in parts) or member.name.startswith("/"):
                    raise UpgradeError(f"archive member {member.name!r} leaves its folder")
                if not (member.isfile() or member.isdir()):
                    raise UpgradeError(f"archive member {member.name!r} is not a file")
                total += member.size
                if total > MAX_UNPACKED_BYTES:
                    raise UpgradeError("archive unpacks to more than "
                                       f"{MAX_UNPACKED_BYTES:,} bytes")
                out = dest.joinpath(*parts)
                if member.isdir():
                    out.mkdir(parents=True, exist_ok=True)
                    continue
                out.parent.mkdir(parents=True, exist_ok=True)
                source = tar.extractfile(member)
                assert source is not None
                out.write_bytes(source.read())
    except (tarfile.TarError, EOFError) as exc:
        raise UpgradeError(f"archive cannot be unpacked: {exc}") from None
    except OSError as exc:  # the phone's storage, this time
        raise NotNow(f"archive not unpacked: {exc}") from None
    init = dest / "agent" / "__init__.py"
    missing = [p for p in PACKAGES if not (dest / p / "__init__.py").is_file()]
    if missing:
        raise UpgradeError(f"archive lacks the package(s) {', '.join(missing)}")
    found = VERSION_LINE.search(init.read_text(errors="replace"))
    if found is None:
        raise UpgradeError("archive's agent/__init__.py names no __version__")
    return found.group(1)
