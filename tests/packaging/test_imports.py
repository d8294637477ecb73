"""The import graph of ``python/kvplan`` has no cycle.

Read statically with ``ast`` from the package's files, so that an import hidden inside a
function (which runs later and only dodges the loop at import time) counts as much as one at the
top of a module. An edge ``a -> b`` means module ``a`` imports ``kvplan`` module ``b``:
``import kvplan.b``, ``from kvplan import b`` (``b`` a module) or ``from kvplan.b import x``;
relative imports are resolved the same way. Importing a submodule does not count as importing
its parent packages' ``__init__`` (every module would then import ``kvplan``).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[2] / "python" / "kvplan"


def module_names(root: Path) -> dict[str, Path]:
    """``kvplan...`` dotted name -> file, for every ``.py`` file of the package and every stub
    of a compiled module (``_core.pyi``: ``from kvplan import _core`` imports a module)."""
    names = {}
    sources = sorted(root.rglob("*.py"))
    stubs = [p for p in sorted(root.rglob("*.pyi")) if p.with_suffix(".py") not in sources]
    for path in sources + stubs:
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def imports_of(name: str, path: Path, modules: set[str]) -> set[str]:
    """The package modules that module ``name`` imports anywhere in its file."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                # Relative: strip `level` components from this module's package.
                package = name.split(".") if is_package else name.split(".")[:-1]
                base = ".".join(package[:len(package) - node.level + 1]
                                + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in modules else base)
    return {m for m in found if m in modules and m != name}


def import_graph(root: Path = PACKAGE_DIR) -> dict[str, set[str]]:
    files = module_names(root)
    return {name: imports_of(name, path, set(files)) for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as ``[a, b, ..., a]``, or ``None``."""
    done: set[str] = set()
    stack: list[str] = []
    on_stack: set[str] = set()

    def visit(node: str) -> list[str] | None:
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt in on_stack:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in done:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        stack.pop()
        on_stack.discard(node)
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done:
            cycle = visit(start)
            if cycle:
                return cycle
    return None


def test_the_package_import_graph_has_no_cycle() -> None:
    graph = import_graph()
    assert len(graph) > 20 and graph["kvplan"] >= {"kvplan._core", "kvplan.policy", "kvplan.report"}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_the_graph_sees_function_level_and_relative_imports(tmp_path: Path) -> None:
    # A miniature package: `a` imports `b` inside a function, `b` imports `a` relatively.
    pkg = tmp_path / "kvplan"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from kvplan import b\n    return b\n")
    (pkg / "b.py").write_text("from .a import f\n")
    (pkg / "c.py").write_text("import kvplan.b\nfrom kvplan import a as x\n")
    graph = import_graph(pkg)
    assert graph == {"kvplan": set(), "kvplan.a": {"kvplan.b"}, "kvplan.b": {"kvplan.a"},
                     "kvplan.c": {"kvplan.a", "kvplan.b"}}
    assert find_cycle(graph) == ["kvplan.a", "kvplan.b", "kvplan.a"]
