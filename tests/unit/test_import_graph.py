"""The package's import graph, read from the code's own imports (module level and inside functions;
imports under ``if TYPE_CHECKING:`` never run and are left out): no circles, and dependencies
pointing the way docs/architecture.md says."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from pdxfer.docgen.architecture import DEPENDENCY_RULES as RULES

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "pdxfer"



def module_names() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the pdxfer modules it imports (``from a import b`` names module a.b when it exists)."""

    def resolve(name: str) -> str | None:
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) in mods:
                return ".".join(parts[:i])
        return None

    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        skip = _type_checking_nodes(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps: set[str | None] = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.Import):
                deps.update(resolve(a.name) for a in node.names if a.name.split(".")[0] == "pdxfer")
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                if base.split(".")[0] != "pdxfer":
                    continue
                for a in node.names:
                    deps.add(resolve(f"{base}.{a.name}") if f"{base}.{a.name}" in mods else resolve(base))
        deps.discard(None)
        deps.discard(name)
        graph[name] = {d for d in deps if d is not None}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    x = stack.pop()
                    on_stack.discard(x)
                    comp.append(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(module_names())


def test_no_import_circles(graph):
    assert circles(graph) == []


@pytest.mark.parametrize("importer,forbidden,why", RULES, ids=[r[0] for r in RULES])
def test_dependencies_point_one_way(graph, importer, forbidden, why):
    wrong = sorted(f"{a} -> {b}" for a, deps in graph.items() if a == importer or a.startswith(importer + ".")
                   for b in deps if any(b == f or b.startswith(f + ".") for f in forbidden))
    assert not wrong, f"{why}: {wrong}"


def test_the_graph_reader_sees_what_it_must():
    """The oracle itself: a planted circle and a planted wrong-way import are found."""
    mods = module_names()
    g = import_graph(mods)
    assert "pdxfer.master.server.master_service" in g["pdxfer.master.cli"]  # a from-import of a module's names
    assert "pdxfer.master.backends.etcd_coordinator" in g["pdxfer.master.backends.choice"]  # one inside a function
    assert "pdxfer.master.server.master_service" not in g["pdxfer.master.server.conn"]  # a TYPE_CHECKING import is left out
    planted = {k: set(v) for k, v in g.items()}
    planted["pdxfer.master.backends.coordinator"].add("pdxfer.master.backends.choice")
    assert ["pdxfer.master.backends.choice", "pdxfer.master.backends.coordinator",
            "pdxfer.master.backends.etcd_coordinator"] in circles(planted)
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
