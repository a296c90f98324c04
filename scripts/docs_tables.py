"""The docs' generated tables, made from the code so that they cannot drift from it:

- docs/deploy.md, between `<!-- settings:begin -->` and `<!-- settings:end -->`: every
  `PHALANX_*` variable of the control plane's `Settings` (domain/settings.py) and the
  scheduler's `Tuning` (`PHALANX_SCHED_*`): name, default, bounds, meaning;
- docs/agent.md, between `<!-- agent-config:begin -->` and `<!-- agent-config:end -->`: the
  agent's config file (`agent.config.AgentConfig`).

A meaning is the field's `description` (a dataclass field's `metadata["doc"]`); a default or a
bound the value cannot say (a generated token, a computed rate) is the field's
`json_schema_extra` `default_text`/`bounds_text`. Edit those, then run

    .venv/bin/python scripts/docs_tables.py           # rewrite the blocks
    .venv/bin/python scripts/docs_tables.py --check   # exit 1 naming each doc that differs

tests/docs/test_generated_tables.py runs the check.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a file: the repository's packages
    sys.path.insert(0, str(ROOT))

from pydantic.fields import FieldInfo  # noqa: E402
from pydantic_settings import BaseSettings  # noqa: E402

from agent.config import AgentConfig  # noqa: E402
from domain.settings import Settings  # noqa: E402
from domain.tuning import Tuning  # noqa: E402

COMMAND = ".venv/bin/python scripts/docs_tables.py"

# The scheduler's knobs say what they mean in comments only (`Tuning` is not this script's to
# edit): their meaning is written here until each has a Field(description=...), and
# the check refuses an entry here for a field that has one (or for no field).
TUNING_MEANINGS = {
    "straggler_floor_s": "a device is never called late sooner than this (`docs/scheduler.md`)",
    "straggler_factor": "a device is late after this x the job's typical step time "
                        "(`docs/scheduler.md`)",
    "apply_claim_ttl_s": "an enqueued apply_step not done by then is enqueued again",
    "lock_ttl_s": "the placement lock's lease: a dead holder frees it by then",
    "long_poll_interval_s": "how often a waiting API process checks the version key in Redis "
                            "while it is not subscribed to its notices (a bump publishes on "
                            "`phalanx:<db>:<key>`; a subscribed replica reads the key once per "
                            "notice, and every 0.25 s against a lost one)",
    "eviction_window_s": "the window of the lease-loss eviction rate limit "
                         "(`docs/scheduler.md`)",
    "apply_threads": "threads sharing apply_step's fused sum + SGD update (same bits for any "
                     "count)",
    "slices_inline": "a sliced job's slices all applied by the task that starts the step, one "
                     "after another, instead of sent to the workers (tests that call tasks "
                     "directly; a deployment without separate workers)",
    "apply_pause_s": "tests only: a sleep between writing state t+1 and its commit",
}
# defaults that depend on the machine the docs are made on
TUNING_DEFAULTS = {"apply_threads": "min(4, CPUs)"}


def _heartbeat_rate_default() -> str:
    """The heartbeat rate's default in words, computed from the code's own rule."""
    defaults = Settings.model_construct()  # the defaults, no environment read
    rate, interval = defaults.heartbeat_rate_per_minute, defaults.heartbeat_interval_s
    return (f"unset: {rate * interval / 60:g}x what the interval asks ({rate:g} a minute at "
            f"{interval:g} s)")


COMPUTED_DEFAULTS: dict[str, Callable[[], str]] = {
    "heartbeat_max_per_minute": _heartbeat_rate_default}


def human(name: str, value: float) -> str:
    """A long duration in hours or days, a byte count in binary units ('' when plain)."""
    if name.endswith("_s") and value >= 3600 and value % 3600 == 0:
        days, hours = divmod(int(value), 86400)
        return f"{days} days" if days > 1 and not hours else f"{int(value) // 3600} h"
    if name.endswith("_bytes") and value >= 1024:
        for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
            if value % size == 0:
                return f"{int(value) // size} {unit}"
    return ""


def shown(name: str, value: Any, none: str = "unset") -> str:
    if value is None:
        return none
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        number = int(value) if float(value).is_integer() else value
        text, unit = f"{number:g}" if isinstance(number, float) else str(number), human(name, value)
        return f"{text} ({unit})" if unit else text
    if isinstance(value, str) and not value:
        return '`""`'
    return f"`{json.dumps(value) if isinstance(value, (list, dict)) else value}`"


def bounds(name: str, field: FieldInfo) -> str:
    extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
    if "bounds_text" in extra:
        return str(extra["bounds_text"])
    parts = [f"{sign} {shown(name, getattr(m, attr))}" for m in field.metadata
             for attr, sign in (("gt", ">"), ("ge", "≥"), ("lt", "<"), ("le", "≤"))
             if getattr(m, attr, None) is not None]
    return ", ".join(parts)


def cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def settings_rows(cls: type[BaseSettings], meanings: dict[str, str],
                  defaults: dict[str, str]) -> list[str]:
    prefix = cls.model_config.get("env_prefix", "")
    rows = []
    for name, field in cls.model_fields.items():
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        if name in COMPUTED_DEFAULTS:
            default = COMPUTED_DEFAULTS[name]()
        elif name in defaults:
            default = defaults[name]
        elif "default_text" in extra:
            default = str(extra["default_text"])
        else:
            default = shown(name, field.get_default(call_default_factory=True))
        meaning = field.description or meanings.get(name, "")
        rows.append(f"| `{prefix}{name.upper()}` | {cell(default)} | {cell(bounds(name, field))} "
                    f"| {cell(meaning)} |")
    return rows


def settings_table() -> str:
    rows = [*settings_rows(Settings, {}, {}),
            *settings_rows(Tuning, TUNING_MEANINGS, TUNING_DEFAULTS)]
    return "\n".join(["| variable | default | bounds | meaning |", "| --- | --- | --- | --- |",
                      *rows])


def agent_config_table() -> str:
    rows = []
    for f in dataclasses.fields(AgentConfig):
        if f.default is not dataclasses.MISSING:
            default = shown(f.name, f.default, none="`null`")
        elif f.default_factory is not dataclasses.MISSING:
            default = shown(f.name, f.default_factory())
        else:
            default = "required (written by `enroll`)"
        rows.append(f"| `{f.name}` | {cell(default)} | {cell(f.metadata.get('doc', ''))} |")
    return "\n".join(["| key | default | meaning |", "| --- | --- | --- |", *rows])


BLOCKS: dict[str, tuple[str, Callable[[], str]]] = {
    "settings": ("docs/deploy.md", settings_table),
    "agent-config": ("docs/agent.md", agent_config_table),
}


def missing_meanings() -> list[str]:
    """Fields the tables would show without a meaning, and stale entries of TUNING_MEANINGS."""
    problems = [f"{cls.__name__}.{name} has no description" for cls, meanings in
                ((Settings, {}), (Tuning, TUNING_MEANINGS))
                for name, field in cls.model_fields.items()
                if not field.description and name not in meanings]
    problems += [f"AgentConfig.{f.name} has no metadata doc" for f in dataclasses.fields(AgentConfig)
                 if not f.metadata.get("doc")]
    problems += [f"TUNING_MEANINGS[{name!r}]: " + ("no such field" if name not in Tuning.model_fields
                 else "the field has its own description now: drop the entry")
                 for name in TUNING_MEANINGS
                 if name not in Tuning.model_fields or Tuning.model_fields[name].description]
    return problems


def with_block(text: str, name: str, body: str, doc: str) -> str:
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    if text.count(begin) != 1 or text.count(end) != 1 or text.index(begin) > text.index(end):
        raise SystemExit(f"{doc}: needs exactly one {begin} ... {end} block")
    head, rest = text.split(begin, 1)
    tail = rest.split(end, 1)[1]
    note = f"<!-- generated by {COMMAND} from the code: edit the code, then run it -->"
    return f"{head}{begin}\n{note}\n{body}\n{end}{tail}"


def expected_docs(root: Path = ROOT) -> dict[Path, tuple[str, str]]:
    """doc path -> (its text now, its text with every block generated)."""
    docs: dict[Path, tuple[str, str]] = {}
    for name, (doc, make) in BLOCKS.items():
        path = root / doc
        if path not in docs:
            text = path.read_text()
            docs[path] = (text, text)
        now, expected = docs[path]
        docs[path] = (now, with_block(expected, name, make(), doc))
    return docs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 when a doc's tables differ from the code")
    args = parser.parse_args(argv)
    problems = missing_meanings()
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)
    stale = []
    for path, (now, expected) in expected_docs().items():
        if now == expected:
            continue
        stale.append(path)
        if args.check:
            sys.stdout.writelines(difflib.unified_diff(
                now.splitlines(True), expected.splitlines(True),
                f"{path.relative_to(ROOT)} (now)", f"{path.relative_to(ROOT)} (from the code)"))
        else:
            path.write_text(expected)
            print(f"rewrote {path.relative_to(ROOT)}")
    if args.check and stale:
        print(f"\nthe tables differ from the code: run `{COMMAND}`", file=sys.stderr)
    return 1 if problems or (args.check and stale) else 0


if __name__ == "__main__":
    sys.exit(main())
