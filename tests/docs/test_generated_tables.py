"""The settings tables in the docs are made from the code (scripts/docs_tables.py): a change
to a setting's default, bounds or description that is not carried into the docs fails here,
with the command that fixes it."""

from __future__ import annotations

import difflib

from tests.docs import tables
from tests.support.server import REPO_ROOT


def test_every_setting_and_config_key_says_what_it_means() -> None:
    assert tables.missing_meanings() == []


def test_the_docs_tables_are_what_the_code_makes() -> None:
    for path, (now, expected) in tables.expected_docs().items():
        diff = "".join(difflib.unified_diff(now.splitlines(True), expected.splitlines(True),
                                            "now", "from the code", n=0))
        assert now == expected, (f"{path.relative_to(REPO_ROOT)}'s generated tables differ from "
                                 f"the code: run `{tables.COMMAND}`\n{diff}")
