"""Docs checked against the code. `tables` is scripts/docs_tables.py, loaded as a module."""

from __future__ import annotations

import importlib.util

from tests.support.server import REPO_ROOT


def _load_docs_tables():
    spec = importlib.util.spec_from_file_location("docs_tables",
                                                  REPO_ROOT / "scripts" / "docs_tables.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


tables = _load_docs_tables()
