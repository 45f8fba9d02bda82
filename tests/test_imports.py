"""Imports run one way (STYLE.md, "Imports that run one way"): no two modules of
src/headwise reach each other through imports.

Every import counts, at any level: module-level, inside a function, under
``TYPE_CHECKING`` (a type-only import still draws the loop in a reader's head). A
``from pkg import name`` where ``pkg.name`` is a module imports that module, otherwise
``pkg`` itself. A package's ``__init__`` importing its submodules is no circle as long
as none of them imports the package back.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _modules(src: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under ``src`` (a package as its ``__init__``)."""
    mods = {}
    for path in src.rglob("*.py"):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def _imported(node: ast.Import | ast.ImportFrom, package: str, mods: dict[str, Path]) -> list[str]:
    """The modules one import statement reaches, by the rule of the module docstring."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:  # relative: from the package, one level up per dot after the first
        parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
        base = ".".join(parts + ([base] if base else []))
    subs = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in mods]
    return subs if len(subs) == len(node.names) else [base, *subs]


def import_graph(src: Path) -> dict[str, set[str]]:
    """Module -> the modules of ``src`` it imports anywhere in its file."""
    mods = _modules(src)
    edges: dict[str, set[str]] = {m: set() for m in mods}
    for m, path in mods.items():
        package = m if path.name == "__init__.py" else m.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges[m] |= {n for n in _imported(node, package, mods) if n in mods and n != m}
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, successors = work[-1]
            w = next(successors, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                component = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    component.append(w)
                    if w == v:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_circles():
    found = circles(import_graph(SRC))
    assert not found, "modules that import each other (move the shared part down, or pass a Protocol):\n" + "\n".join(
        " <-> ".join(component) for component in found)


def test_the_walk_sees_lazy_type_only_and_from_package_imports(tmp_path):
    """The walker itself: each kind of import closes a circle it must report."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg import low\n")
    (pkg / "low.py").write_text("def f():\n    from pkg.high import g  # lazy\n")
    (pkg / "high.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import low\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "a.py").write_text("from . import b\n")  # relative, a module: imports pkg.sub.b
    (pkg / "sub" / "b.py").write_text("from pkg.sub import VALUE\n")  # a name, not a module: imports pkg.sub
    (pkg / "lone.py").write_text("import pkg.low\n")  # one way only: no circle
    edges = import_graph(tmp_path)
    assert edges["pkg.sub.a"] == {"pkg.sub.b"} and edges["pkg.sub.b"] == {"pkg.sub"}
    assert circles(edges) == [["pkg.high", "pkg.low"]]
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub import a\n")
    assert sorted(circles(import_graph(tmp_path))) == [["pkg.high", "pkg.low"], ["pkg.sub", "pkg.sub.a", "pkg.sub.b"]]
