"""The agent's side of a rollout: install the build a heartbeat's `upgrade` command names, then
exit for runit to start it (agent/slots.py, agent/launch.sh); end a new build's trial once it
has heartbeated; report a build that could not be installed or was rolled back, so the server
stops asking for it.

A command is only a suggestion: what gets installed must be signed by a release key this agent
trusts (agent/release.py), or, for an agent that holds none, come over https. A forged
command or a tampered archive is refused and reported, never unpacked."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from agent import __version__, release
from agent.client import Client, ClientError, StatusError
from agent.slots import MAX_ARCHIVE_BYTES, NotNow, Slots, UpgradeError

log = logging.getLogger(__name__)
NO_LAUNCHER = ("this agent was not started by launch.sh (PHALANX_AGENT_HOME unset): nothing "
               "would start a new build or roll it back; reinstall with install.sh")
NO_KEY = ("this agent holds no release key and its server is plain http, where anyone on the "
          "network could forge the upgrade: refused. Reinstall the phone with the install line "
          "(the archive it installs carries the server's key), pin the key in "
          f"$PHALANX_AGENT_HOME/{release.PINNED_FILE}, or serve https")


class Upgrader:
    def __init__(self, client: Client, device_id: str, slots: Slots | None,
                 busy: Callable[[], bool], release_keys: list[bytes] | None = None) -> None:
        """`release_keys`: the keys a build must be signed by; default: the ones this agent
        trusts (agent.release.trusted_keys), read again for each command (a pin added to the
        agent home counts without a restart)."""
        self.client, self.device_id, self.slots, self.busy = client, device_id, slots, busy
        self.release_keys = release_keys
        self.reports: list[tuple[str, str, str]] = []  # (version, outcome, detail) to send
        self.reported: set[str] = set()  # versions this process reported: not tried again
        self.restart_for: str | None = None
        self.trial_checked = False  # a trial is ended at the first answered heartbeat only
        if slots is not None:
            rolled = slots.rolled_back()
            if rolled:
                version = rolled.rsplit("-", 1)[0]
                log.warning("agent %s did not start (rolled back by launch.sh); running %s",
                            version, __version__)
                self._report(version, "rolled_back", f"the new agent did not reach the server "
                             f"in its first starts; {__version__} runs again")

    def _keys(self) -> list[bytes]:
        if self.release_keys is not None:
            return self.release_keys
        return release.trusted_keys(self.slots.home if self.slots is not None else None)

    def _report(self, version: str, outcome: str, detail: str) -> None:
        self.reports.append((version, outcome, detail))
        self.reported.add(version)

    def after_heartbeat(self) -> None:
        """The server answered: a new build's trial ends; pending reports go out (again
        after the next heartbeat if this fails)."""
        if self.slots is not None and not self.trial_checked:
            self.trial_checked = True
            if self.slots.confirm(__version__):
                log.info("agent %s reached the server: upgrade kept", __version__)
        while self.reports:
            version, outcome, detail = self.reports[0]
            try:
                self.client.report_upgrade(self.device_id, version, outcome, detail)
            except StatusError as exc:
                if exc.status >= 500 or exc.status == 429:
                    log.warning("could not report the failed upgrade to %s: %s", version, exc)
                    return
                log.error("the server refused the report of %s: %s", version, exc)  # dropped
            except ClientError as exc:
                log.warning("could not report the failed upgrade to %s: %s", version, exc)
                return
            self.reports.pop(0)
            if outcome == "rolled_back" and self.slots is not None:
                self.slots.reported()

    def handle(self, cmd: dict[str, Any], stop: threading.Event) -> None:
        """An `upgrade` command: install the build and stop this agent (runit restarts it)."""
        version, sha256, path = cmd.get("version"), cmd.get("sha256"), cmd.get("url")
        if not (isinstance(version, str) and isinstance(sha256, str) and isinstance(path, str)):
            log.error("upgrade command without version, sha256 and url: %s", cmd)
            return
        if version == __version__ or version in self.reported or self.restart_for:
            return  # already running it (the server sees so soon), or given up on it
        if self.slots is None:
            log.error("cannot upgrade to %s: %s", version, NO_LAUNCHER)
            self._report(version, "failed", NO_LAUNCHER)
            return
        keys = self._keys()
        if not keys and not self.client.over_https:
            log.error("cannot upgrade to %s: %s", version, NO_KEY)
            self._report(version, "failed", NO_KEY)
            return
        if self.busy():
            return  # a step in hand: the command comes again with the next heartbeat
        log.info("upgrading agent %s -> %s", __version__, version)
        try:
            archive, signature = self.client.agent_archive(path, MAX_ARCHIVE_BYTES)
            if keys:
                key = release.check(archive, signature, version, sha256, keys)
                log.info("agent %s is signed by release key %s", version,
                         release.fingerprint(key))
            else:
                log.warning("agent %s: no release key to check it by; trusting the server's "
                            "https certificate", version)
            slot = self.slots.install(archive, sha256, version)
        except (UpgradeError, ValueError) as exc:
            log.error("cannot upgrade to %s: %s", version, exc)
            self._report(version, "failed", str(exc))
            return
        except (NotNow, ClientError, OSError) as exc:  # the server or the disk, this time
            log.warning("upgrade to %s not installed this time (%s): asked again", version, exc)
            return
        log.info("agent %s installed in slot %s: restarting into it", version, slot)
        self.restart_for = version
        stop.set()
