"""The package layout's promises that import-linter's contracts (make lint) do not cover:
no import cycle between any two modules of the project, function-level imports included,
and a core that imports nothing of the project."""

from __future__ import annotations

import grimp

PACKAGES = ("tidegate", "tidegate_tools", "api", "tasks", "workers", "scheduler", "store")
LAYERS = ("api", "tasks", "workers", "scheduler", "store", "tidegate_tools")


def _graph() -> grimp.ImportGraph:
    return grimp.build_graph(*PACKAGES, cache_dir=None)


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Each import a -> b where b leads back to a, as the cycle's chain of modules."""
    found = []
    for module in sorted(graph.modules):
        for imported in sorted(graph.find_modules_directly_imported_by(module)):
            back = graph.find_shortest_chain(importer=imported, imported=module)
            if back is not None:
                found.append([module, *back])
    return found


def test_no_module_of_the_project_imports_one_that_imports_it_back() -> None:
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    graph = grimp.ImportGraph()
    for module in ("a", "a.x", "a.y", "a.z"):
        graph.add_module(module)
    graph.add_import(importer="a.x", imported="a.y")
    graph.add_import(importer="a.y", imported="a.x")
    graph.add_import(importer="a.z", imported="a.x")
    assert _cycles(graph) == [["a.x", "a.y", "a.x"], ["a.y", "a.x", "a.y"]]


def test_the_core_imports_nothing_of_the_project() -> None:
    graph = _graph()
    upward = {(module, imported) for module in graph.find_children("tidegate")
              for imported in graph.find_modules_directly_imported_by(module)
              if imported.split(".")[0] in LAYERS}
    assert upward == set()
