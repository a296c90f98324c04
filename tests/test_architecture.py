"""The layer rules that import-linter cannot state: no import cycle between any two modules.

grimp (import-linter's graph) reads every import statement, those inside functions included, so
an import moved into a function to dodge a cycle is still a cycle here. Imports under
`if TYPE_CHECKING:` are left out: they never run. The layer contracts themselves are in
pyproject.toml and run by `lint-imports` in the test command.
"""

from __future__ import annotations

import grimp

PACKAGES = ("agent", "engine", "wire", "hotstate", "api", "scheduler", "phalanx")


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
