"""Docs that drift from the code are bugs: every `PHALANX_*` setting is in docs/deploy.md's
settings table, and every `PHALANX_*` name the docs mention is read by the code."""

from __future__ import annotations

import re
from pathlib import Path

from domain.settings import Settings
from domain.tuning import Tuning
from tests.support.server import REPO_ROOT

NAME = re.compile(r"PHALANX_[A-Z0-9_]*[A-Z0-9]")
DOCS = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md")),
        REPO_ROOT / "docker-compose.yml", *sorted((REPO_ROOT / "deploy").rglob("*.yaml")),
        REPO_ROOT / "deploy" / "Dockerfile"]
CODE_DIRS = ("agent", "engine", "wire", "hotstate", "api", "scheduler", "phalanx", "scripts", "tests")


def settings_names() -> set[str]:
    return ({f"PHALANX_{n.upper()}" for n in Settings.model_fields}
            | {f"PHALANX_SCHED_{n.upper()}" for n in Tuning.model_fields})


def names_in(paths: list[Path]) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for path in paths:
        for name in NAME.findall(path.read_text(errors="replace")):
            found.setdefault(name, path)
    return found


def names_read_by_code() -> set[str]:
    """Names that appear in the code outside this file: settings fields are matched above;
    the agent's, the CLI's and the test harness's variables are string literals."""
    here = Path(__file__).resolve()
    files = [p for d in CODE_DIRS for p in (REPO_ROOT / d).rglob("*")
             if p.suffix in (".py", ".sh") or p.name == "test"]
    return set(names_in([p for p in files if p.is_file() and p.resolve() != here]))


def test_every_setting_is_in_the_deploy_settings_table() -> None:
    table = (REPO_ROOT / "docs" / "deploy.md").read_text().split("## Settings", 1)[1]
    table = table.split("\n## ", 1)[0]
    missing = {name for name in settings_names() if f"`{name}`" not in table}
    assert not missing, f"settings missing from docs/deploy.md's table: {sorted(missing)}"


def test_every_documented_name_exists() -> None:
    known = settings_names() | names_read_by_code()
    unknown = {name: str(path.relative_to(REPO_ROOT))
               for name, path in names_in(DOCS).items() if name not in known}
    assert not unknown, f"documented but read by nothing: {unknown}"
