"""The layering docs/contributing.md states, read from the code's own imports (every ``import``, at any depth of a module).

``contract`` imports nothing of the project; ``runtime`` (what a client installs) only ``contract``; the engines
(``backends``) only ``contract``; and no two packages import each other, directly or through a third.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from graphlib import CycleError, TopologicalSorter

from harness.daemon import ROOT

PACKAGES = ("contract", "runtime", "modeld", "backends", "harness", "benchmarks", "tests")


def imports(package: str) -> dict[str, set[str]]:
    """The project's other packages ``package`` imports → the files that import each."""
    found: dict[str, set[str]] = defaultdict(set)
    for path in sorted((ROOT / package).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.partition(".")[0]
                if top in PACKAGES and top != package:
                    found[top].add(str(path.relative_to(ROOT)))
    return found


def test_the_walk_sees_imports_at_any_depth() -> None:
    """(The walk itself: the front imports the client library, and the composition root the engines inside
    functions.)"""
    assert "runtime" in imports("modeld") and "backends" in imports("modeld")
    assert "contract" in imports("runtime")


def test_contract_imports_nothing_of_the_project() -> None:
    assert dict(imports("contract")) == {}


def test_the_client_library_imports_only_the_contract() -> None:
    """A client-only install (``pip install modeld``) has ``runtime`` and ``contract``: the daemon's install adds
    to the client's commands through ``runtime.cli.Extensions``, never by an import."""
    assert set(imports("runtime")) == {"contract"}, dict(imports("runtime"))


def test_the_engines_import_only_the_contract() -> None:
    assert set(imports("backends")) <= {"contract"}, dict(imports("backends"))


def test_no_two_packages_import_each_other() -> None:
    graph = {package: set(imports(package)) for package in PACKAGES}
    try:
        order = list(TopologicalSorter(graph).static_order())
    except CycleError as exc:
        cycle = exc.args[1]
        raise AssertionError(f"the packages import each other: {' -> '.join(cycle)}") from None
    assert set(order) == set(PACKAGES)
