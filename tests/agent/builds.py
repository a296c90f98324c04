"""Agent builds other than the checkout's, for upgrade tests: a copy of the agent package with
another version (and, `broken`, one whose `python -m agent` exits at once), and its archive as
a server would serve it."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

from api.agent_dist import build_archive
from tests.agent.helpers import REPO

BROKEN_MAIN = 'raise SystemExit("this agent build cannot start")\n'


def agent_tree(dest: Path, version: str, *, broken: bool = False) -> Path:
    """`dest` holding `agent/` (the checkout's, at `version`): a folder to run a server from
    (its cwd comes first on the path), so it serves this build."""
    shutil.copytree(REPO / "agent", dest / "agent",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    init = dest / "agent" / "__init__.py"
    init.write_text(re.sub(r'^__version__ = "[^"]*"$', f'__version__ = "{version}"',
                           init.read_text(), flags=re.M))
    if broken:
        (dest / "agent" / "__main__.py").write_text(BROKEN_MAIN)
    return dest


def archive(tree: Path, version: str) -> bytes:
    return build_archive({"agent": tree / "agent", "engine": REPO / "engine",
                          "wire": REPO / "wire"}, version)
