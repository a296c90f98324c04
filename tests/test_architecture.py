"""The layer rules that import-linter cannot state: no import cycle between any two modules, no
two packages that import each other, and no state spelled outside its enum (wire/states.py).

grimp (import-linter's graph) reads every import statement, those inside functions included, so
an import moved into a function to dodge a cycle is still a cycle here. Imports under
`if TYPE_CHECKING:` are left out: they never run. The layer contracts themselves are in
pyproject.toml and run by `lint-imports` in the test command.
"""

from __future__ import annotations

import re
from pathlib import Path

import grimp

from wire.states import DeviceState, JobState

PACKAGES = ("agent", "engine", "wire", "hotstate", "domain", "api", "scheduler", "roots",
            "phalanx", "pictures")
REPO = Path(__file__).resolve().parent.parent


def import_cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = 0
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.find_modules_directly_imported_by(child)))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    cycles.append(sorted(component))
    return cycles


def test_no_module_imports_itself_through_others() -> None:
    graph = grimp.build_graph(*PACKAGES, cache_dir=None, exclude_type_checking_imports=True)
    assert len(graph.modules) > 140  # every package was found
    assert import_cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle_made_inside_a_function(tmp_path, monkeypatch) -> None:
    package = tmp_path / "cyc"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from cyc import b\n")
    (package / "b.py").write_text("def later():\n    from cyc import a\n")
    (package / "c.py").write_text("from cyc import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    graph = grimp.build_graph("cyc", cache_dir=None)
    assert import_cycles(graph) == [["cyc.a", "cyc.b"]]


def package_imports(graph: grimp.ImportGraph) -> dict[str, set[str]]:
    """package -> the other packages its modules import directly."""
    edges: dict[str, set[str]] = {p: set() for p in PACKAGES}
    for module in graph.modules:
        source = module.split(".")[0]
        for imported in graph.find_modules_directly_imported_by(module):
            target = imported.split(".")[0]
            if target != source and target in edges:
                edges[source].add(target)
    return edges


def test_no_two_packages_import_each_other() -> None:
    edges = package_imports(grimp.build_graph(*PACKAGES, cache_dir=None,
                                              exclude_type_checking_imports=True))
    mutual = sorted((a, b) for a in edges for b in edges[a] if a < b and a in edges[b])
    assert mutual == []
    # the layers as docs/architecture.md draws them: each arrow points down
    assert edges["scheduler"] >= {"domain"} and "api" not in edges["scheduler"]
    assert "scheduler" not in edges["api"] and "api" not in edges["domain"]


STATE_NAMES = sorted({s.value for s in JobState} | {s.value for s in DeviceState})
# a state's string in quotes: a Python literal, or one inside SQL or a script
QUOTED_STATE = re.compile("[\"'](" + "|".join(STATE_NAMES) + ")[\"']")


def quoted_states(text: str) -> list[str]:
    return [m.group(1) for m in QUOTED_STATE.finditer(text)]


def test_no_state_is_spelled_outside_its_enum() -> None:
    """A renamed state changes in one place: every other module names it through wire.states
    (in SQL too, from its values). Tests may spell them: they check the wire's strings."""
    found = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*")):
            if path.suffix not in (".py", ".js", ".html", ".sql") or path.name == "states.py" \
                    and path.parent.name == "wire":
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if quoted_states(line):
                    found.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert found == []


def test_the_state_finder_finds_literals_in_python_and_sql() -> None:
    assert quoted_states("if job['state'] == 'Running':") == ["Running"]
    assert quoted_states('WHERE state IN (\'Pending\', "NotReady")') == ["Pending", "NotReady"]
    assert quoted_states("a job is Pending until placed; JobState.PENDING") == []
