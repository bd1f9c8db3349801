"""No import circles in the product code: its module import graph, read with `ast` (nothing is
imported), has no cycle but those in ALLOWED.

Every import statement counts, also one inside a function: an import put in a function only to
dodge a circle is still the circle. Relative imports are resolved; ``from package import name``
is an edge to ``package.name`` where that is a module, else to the package. Importing ``a.b`` also
runs ``a/__init__.py``; that implicit edge is not counted (a package's __init__ importing its own
modules is no circle of the code's making). Imports of anything outside PACKAGES are ignored.
"""
from __future__ import annotations

import ast
from pathlib import Path

from tests.support.paths import ROOT

PACKAGES = ("engine_worker", "gateway", "kernels", "shared", "tokenizer_service")

# The circles still there, each a set of modules that import one another (a strongly connected
# component). Whoever breaks one removes it here: test_allowed_cycles_still_exist says so.
ALLOWED: dict[frozenset[str], str] = {}


def module_files(root: Path = ROOT) -> dict[str, Path]:
    """Dotted module name -> its file, for every module of PACKAGES."""
    out = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imported(module: str, path: Path, node: ast.AST) -> list[str]:
    """The dotted names an import statement in `module` names (a module, or a name in one)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    return [f"{base}.{a.name}" for a in node.names if a.name != "*"] or [base]


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """module -> the modules of PACKAGES it imports, anywhere in its file."""
    files = module_files(root)
    graph: dict[str, set[str]] = {m: set() for m in files}
    for module, path in files.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            for name in _imported(module, path, node):
                while name and name not in files:        # a name in a module: that module
                    name = name.rpartition(".")[0]
                if name and name != module:
                    graph[module].add(name)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.add(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def _describe(component: frozenset[str], graph: dict[str, set[str]]) -> str:
    edges = [f"{a} -> {b}" for a in sorted(component) for b in sorted(graph[a] & component)]
    return "{" + ", ".join(sorted(component)) + "}: " + "; ".join(edges)


def test_no_import_cycles_but_the_allowed():
    graph = import_graph()
    assert len(graph) > 100 and graph["gateway.app"]          # the walk found the product code
    new = [c for c in cycles(graph) if c not in ALLOWED]
    assert not new, "import cycles:\n" + "\n".join(_describe(c, graph) for c in new)


def test_allowed_cycles_still_exist():
    found = set(cycles(import_graph()))
    stale = [c for c in ALLOWED if c not in found]
    assert not stale, "no longer a cycle (remove it from ALLOWED): " + "; ".join(sorted(map(str, map(sorted, stale))))


def test_the_graph_sees_function_level_and_relative_imports(tmp_path):
    for package in PACKAGES:
        (tmp_path / package).mkdir()
    pkg = tmp_path / "shared"
    (pkg / "sub").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from shared.b import g\n")
    (pkg / "b.py").write_text("from .sub import c\nimport json\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "c.py").write_text("from .. import a\nfrom ..a import f\n")
    graph = import_graph(tmp_path)
    assert graph["shared.a"] == {"shared.b"} and graph["shared.b"] == {"shared.sub.c"}
    assert graph["shared.sub.c"] == {"shared.a"}
    assert cycles(graph) == [frozenset({"shared.a", "shared.b", "shared.sub.c"})]
