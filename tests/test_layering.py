"""The layering docs/contributing.md states, read from the code's own imports (every ``import``, at any depth of a module).

``contract`` imports nothing of the project; ``runtime`` (what a client installs) only ``contract``; the engines
(``backends``) only ``contract``; and no two packages import each other, directly or through a third.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

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


# --- files: no import circle crosses a package ---------------------------------------------------------------------

#: the packages whose files the file-level graph holds
FILE_PACKAGES = ("contract", "runtime", "modeld", "backends")


def module_name(path: Path) -> str:
    """``backends/llama/spec.py`` → ``backends.llama.spec``; a package's ``__init__.py`` is the package."""
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def file_graph() -> tuple[dict[str, set[str]], dict[str, str]]:
    """Every file of ``FILE_PACKAGES`` → the files it imports (every ``import`` at any depth, relative ones
    resolved, a name imported from a package taken as its submodule when it is one), and each file's package (the
    directory holding it)."""
    files = {module_name(p): p for package in FILE_PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}
    package_of = {name: str(path.parent.relative_to(ROOT)).replace("/", ".") for name, path in files.items()}

    def known(name: str) -> str | None:
        """``name``, or its longest prefix that is a file of the graph; None for another project's module."""
        parts = name.split(".")
        while parts and ".".join(parts) not in files:
            parts.pop()
        return ".".join(parts) or None

    graph: dict[str, set[str]] = {name: set() for name in files}
    for name, path in files.items():
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            targets: list[str | None] = []
            if isinstance(node, ast.Import):
                targets = [known(alias.name) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join([*here[:len(here) - node.level + 1], *([node.module] if node.module else [])]
                                if node.level else [node.module or ""])
                targets = [known(f"{base}.{alias.name}") if f"{base}.{alias.name}" in files else known(base)
                           for alias in node.names]
            graph[name] |= {t for t in targets if t is not None and t != name}
    return graph, package_of


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    found.append(sorted(component))
    return found


def test_the_file_graph_sees_relative_imports_inside_functions() -> None:
    """(The graph itself: the registry lists each engine's spec, whose factory imports the engine's backend when
    called; a name imported from a package is the package's file unless it is a submodule.)"""
    graph, package_of = file_graph()
    assert "backends.llama.spec" in graph["backends.registry"]
    assert "backends.llama.backend" in graph["backends.llama.spec"]
    assert "backends.engine_spec" in graph["backends.llama.spec"]
    assert package_of["backends.llama"] == package_of["backends.llama.spec"] == "backends.llama"
    assert strongly_connected({"a": {"b"}, "b": {"a", "c"}, "c": set()}) == [["c"], ["a", "b"]]


def test_no_import_circle_crosses_a_package() -> None:
    """Files of one package may import each other; files of different packages never do, directly or through
    others (``backends.registry`` lists the engines' specs and no engine imports the registry)."""
    graph, package_of = file_graph()
    crossing = []
    for component in strongly_connected(graph):
        if len({package_of[m] for m in component}) > 1:
            members = set(component)
            edges = sorted(f"{a} -> {b}" for a in component for b in graph[a]
                           if b in members and package_of[a] != package_of[b])
            crossing.append(f"{{{', '.join(component)}}} through {'; '.join(edges)}")
    assert not crossing, "import circles across packages: " + " | ".join(crossing)
