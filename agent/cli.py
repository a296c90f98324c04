"""`phalanx-agent enroll | run | probe | install-launcher` (DESIGN.md fixes the first three)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import sys
import threading
from pathlib import Path
from typing import Any

from agent import __version__, release
from agent.client import Client, ClientError, StatusError
from agent.config import AgentConfig, ConfigError, resolve_path, save
from agent.hardware import collect_spec
from agent.probes import Probes
from agent.slots import DEFAULT_HOME, HOME_ENV, Slots

EXIT_STOPPED = 3  # token revoked / device deleted: re-enroll, do not just restart


def _labels(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--label wants key=value, got {pair!r}")
        out[key] = value
    return out


def cmd_enroll(args: argparse.Namespace) -> int:
    path = resolve_path(args.config)
    name = args.name or socket.gethostname()
    ca_file = str(Path(args.ca_file).expanduser().resolve()) if args.ca_file else None
    if ca_file is not None and not Path(ca_file).is_file():
        print(f"--ca-file {args.ca_file}: no such file", file=sys.stderr)
        return 2
    spec = collect_spec()
    try:
        reply = Client(args.server, timeout_s=30, ca_file=ca_file).register(args.token, name, _labels(args.label), spec)
    except StatusError as exc:
        print(f"enrollment refused: {exc.detail} (HTTP {exc.status})", file=sys.stderr)
        return 2
    except ClientError as exc:
        print(f"cannot reach {args.server}: {exc}", file=sys.stderr)
        return 1
    cfg = AgentConfig(server=args.server, device_id=str(reply["device_id"]),
                      device_token=str(reply["device_token"]), name=name, labels=_labels(args.label),
                      ca_file=ca_file or "")
    interval = reply.get("heartbeat_interval_s")
    if isinstance(interval, (int, float)):
        cfg.heartbeat_interval_s = float(interval)
    save(path, cfg)
    print(json.dumps({"device_id": cfg.device_id, "name": name, "config": str(path)}))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from agent.runtime.agent import AgentRuntime, AgentStopped  # numpy etc. only when running
    from agent.runtime.executor import close_all

    try:
        runtime = AgentRuntime(resolve_path(args.config))
    except ConfigError as exc:
        print(f"phalanx-agent: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: stop.set())
    logging.getLogger(__name__).info("agent %s running as %s against %s", __version__,
                                     runtime.config.device_id, runtime.config.server)
    try:
        runtime.run(stop)
    except AgentStopped as exc:
        print(f"phalanx-agent stopped: {exc}", file=sys.stderr)
        return EXIT_STOPPED
    finally:  # SIGTERM, SIGHUP and Ctrl-C alike: no compute worker outlives the agent
        close_all()
    if runtime.upgrader.restart_for:  # runit starts launch.sh again: the new build, on trial
        print(f"phalanx-agent: agent {runtime.upgrader.restart_for} installed; exiting for "
              "the service manager to start it", file=sys.stderr)
    return 0


def cmd_install_launcher(args: argparse.Namespace) -> int:
    """Copy this agent's launch.sh to the agent home (where runit's run script finds it), and
    forget any upgraded slot: after a (re)install, the installed agent runs."""
    home = Path(args.home or os.environ.get(HOME_ENV) or DEFAULT_HOME).expanduser()
    pin = None
    if args.release_key:
        try:
            pin = release.parse_key(args.release_key)
        except ValueError as exc:
            print(f"--release-key: {exc}", file=sys.stderr)
            return 2
    home.mkdir(parents=True, exist_ok=True)
    if pin is not None:  # the key upgrades must be signed by, besides the package's own
        tmp = home / f".{release.PINNED_FILE}.tmp"
        tmp.write_text(pin.hex() + "\n")
        os.replace(tmp, home / release.PINNED_FILE)
    target = home / "launch.sh"
    tmp = home / ".launch.sh.tmp"
    tmp.write_bytes((Path(__file__).resolve().parent / "launch.sh").read_bytes())
    tmp.chmod(0o755)
    os.replace(tmp, target)
    Slots(home).reset()  # a fresh install runs the agent just installed, not an old slot
    print(target)
    return 0


def cmd_probe(args: argparse.Namespace) -> int:
    out: dict[str, Any] = {"reading": Probes().read(), "spec": collect_spec()}
    home = os.environ.get(HOME_ENV)
    # the keys an upgrade must be signed by (fingerprints): compare with `phalanx agents key`
    out["release_keys"] = [release.fingerprint(k) for k in release.trusted_keys(
        Path(home).expanduser() if home else Path(DEFAULT_HOME).expanduser())]
    if args.config and Path(args.config).expanduser().exists():
        out["config"] = str(resolve_path(args.config))
    print(json.dumps(out, indent=2, sort_keys=True, default=str))
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="phalanx-agent", description="Phalanx phone agent")
    p.add_argument("--version", action="version", version=__version__)
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = p.add_subparsers(dest="command", required=True)
    help_config = "config file (default ~/.config/phalanx-agent/config.json)"
    enroll = sub.add_parser("enroll", help="register this phone with the control plane")
    enroll.add_argument("--server", required=True, help="control plane URL, http(s)://host:port")
    enroll.add_argument("--token", required=True, help="enrollment token from an admin")
    enroll.add_argument("--name", help="device name (default: hostname)")
    enroll.add_argument("--label", action="append", default=[], metavar="K=V")
    enroll.add_argument("--ca-file", help="PEM CA certificate of an https server signed by the "
                        "lab's own CA (kept in the config for `run`)")
    enroll.add_argument("--config", help=help_config)
    enroll.set_defaults(func=cmd_enroll)
    run = sub.add_parser("run", help="heartbeat and train until stopped")
    run.add_argument("--config", help=help_config)
    run.set_defaults(func=cmd_run)
    launcher = sub.add_parser("install-launcher", help="copy launch.sh (starts the current "
                              "build, rolls back a failed upgrade) to the agent home")
    launcher.add_argument("--home", help=f"agent home (default ${HOME_ENV} or {DEFAULT_HOME})")
    launcher.add_argument("--release-key", metavar="HEX", help="pin the server's release key "
                          "(`phalanx agents key`) in the agent home: upgrades signed by it are "
                          "installed (an agent installed from the server's archive already "
                          "carries it)")
    launcher.set_defaults(func=cmd_install_launcher)
    probe = sub.add_parser("probe", help="print one reading of every probe as JSON")
    probe.add_argument("--config", help=help_config)
    probe.set_defaults(func=cmd_probe)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
