"""A real headless browser (Debian's chromium) for the pages' tests: the DOM after rendering,
what the browser logged, and a screenshot. scripts/test installs chromium when it is absent
(scripts/services.sh ensure_chromium) and says how to get it otherwise."""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Rendered:
    dom: str
    log: str  # chromium's own log (stderr): console messages and failed loads show here


def chromium() -> str:
    path = os.environ.get("PHALANX_TEST_CHROMIUM") or shutil.which("chromium")
    assert path, ("the page tests need a headless Chromium: apt-get install chromium, or set "
                  "PHALANX_TEST_CHROMIUM (scripts/test installs it when it can)")
    return path


def _run(args: list[str], profile: Path) -> subprocess.CompletedProcess[str]:
    base = [chromium(), "--headless=new", "--no-sandbox", "--disable-gpu",
            "--disable-dev-shm-usage", "--no-first-run", f"--user-data-dir={profile}",
            "--enable-logging=stderr", "--v=0"]
    return subprocess.run(base + args, capture_output=True, text=True, timeout=120)


def render(page: Path, tmp_path: Path, screenshot: Path | None = None) -> Rendered:
    """The page as the browser built it (after layout), and what it logged while doing so."""
    done = _run(["--dump-dom", page.resolve().as_uri()], tmp_path / "chromium-profile")
    assert done.returncode == 0, done.stderr[-2000:]
    if screenshot is not None:
        shot = _run([f"--screenshot={screenshot}", "--window-size=1180,1500",
                     "--hide-scrollbars", page.resolve().as_uri()], tmp_path / "chromium-shot")
        assert shot.returncode == 0 and screenshot.exists(), shot.stderr[-2000:]
    return Rendered(done.stdout, done.stderr)


def console_errors(log: str) -> list[str]:
    """What the page itself complained of: console messages and failed loads (a page that
    reaches for a CDN fails to load it here)."""
    return [line for line in log.splitlines()
            if "CONSOLE" in line or "net::ERR_" in line or "Failed to load" in line]
