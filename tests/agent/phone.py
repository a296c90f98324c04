"""Fixture phones for the agent's tests: sysfs trees from shared/android/ and a fake Termux:API.

`build_tree(root, variant)` writes the rooted Galaxy S10+ sample as real files, then:
- "rooted": as sampled;
- "unrooted": power_supply and thermal unreadable, as SELinux makes them. Tests run as root,
  which ignores permission bits, so denial is simulated with paths that fail to open the way a
  denied one does (a dangling symlink and a directory where a file should be); a separate test
  drops to an unprivileged user for a real EACCES;
- "garbage": every value replaced by junk.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

# copies of shared/android/, kept in the repository so any clone runs the suite
ANDROID = Path(__file__).resolve().parents[1] / "fixtures" / "android"
SYSFS_SAMPLE = ANDROID / "sysfs-galaxy-s10plus-sm8150.txt"
TERMUX_NEW = ANDROID / "termux-battery-status.json"
TERMUX_OLD = ANDROID / "termux-battery-status-old.json"


def sample_entries() -> dict[str, str]:
    out = {}
    for line in SYSFS_SAMPLE.read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        path, _, content = line.partition("\t")
        out[path] = content.replace("\\n", "\n")
    return out


def write(root: Path, abspath: str, content: str) -> Path:
    path = root / abspath.lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content + "\n")
    return path


def build_tree(root: Path, variant: str = "rooted") -> Path:
    for abspath, content in sample_entries().items():
        write(root, abspath, content)
    if variant == "unrooted":
        deny(root, "/sys/class/power_supply")
        deny(root, "/sys/class/thermal")
    elif variant == "garbage":
        for abspath in sample_entries():
            write(root, abspath, "\x00\xff garbage -- nan 9" * 3)
    elif variant != "rooted":
        raise ValueError(variant)
    return root


def deny(root: Path, abspath: str) -> None:
    """Make every file below `abspath` fail to open (dangling symlinks / directories)."""
    base = root / abspath.lstrip("/")
    files = [p for p in base.rglob("*") if p.is_file()]
    for i, path in enumerate(files):
        path.unlink()
        if i % 2:
            path.mkdir()
        else:
            path.symlink_to(root / "nonexistent" / path.name)


def set_value(root: Path, abspath: str, value: object) -> None:
    """Change one value atomically, as a kernel would (no torn reads for the agent)."""
    path = root / abspath.lstrip("/")
    tmp = path.with_name(path.name + ".new")
    tmp.write_text(f"{value}\n")
    os.replace(tmp, path)


def fake_termux(bin_dir: Path, payload: dict | str | None, *, hang: bool = False,
                exit_code: int = 0) -> Path:
    """A `termux-battery-status` on PATH printing `payload` (or hanging, as a dead API does)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / "termux-battery-status"
    if hang:
        # a child process holding stdout, like the real one's am call; both pids go to `calls`
        calls = bin_dir / "calls"
        body = f"echo $$ >> '{calls}'\nsleep 600 &\necho $! >> '{calls}'\nwait\n"
    else:
        text = payload if isinstance(payload, str) else json.dumps(payload)
        data = bin_dir / "battery.json"
        data.write_text(text or "")
        body = f"cat '{data}'\nexit {exit_code}\n"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(script.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return script


def termux_payload(old: bool = False) -> dict:
    return json.loads((TERMUX_OLD if old else TERMUX_NEW).read_text())


def copy_tree(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst
