"""The package's layout, read from its source with ``ast`` (nothing of it is run): no import circles, the
command-line tools (``lightning_mp/tools``) imported only by the entry points, the parts below the plugin
(ARCHITECTURE.md: a part never imports the plugin; callbacks import ``stats`` and ``modes`` only).

Every ``import`` and ``from ... import`` statement counts, those inside functions too; relative imports are
resolved. An import names one module of the package, and that is the edge:

- ``import lightning_mp.a.b`` and ``from lightning_mp.a.b import name``: ``lightning_mp.a.b``;
- ``from lightning_mp.a import b`` where ``b`` is a submodule: ``lightning_mp.a.b``;
- ``import lightning_mp`` and ``from lightning_mp import Name``: the package's ``__init__`` only (``lightning_mp``).

The parent packages that Python also runs for a dotted import are not edges: every import between two modules of
one subpackage would otherwise close a circle through that subpackage's ``__init__``.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import NamedTuple, Optional

import pytest

import lightning_mp

PACKAGE = "lightning_mp"
TOOLS = f"{PACKAGE}.tools"
PLUGIN = f"{PACKAGE}.plugin"
#: the command line (``python -m lightning_mp``), which runs the tools
MAIN = f"{PACKAGE}.__main__"
#: the old paths of two tools, kept as the same modules (each puts its tools/ module in its place)
ALIASES = {f"{PACKAGE}.compare": f"{TOOLS}.compare", f"{PACKAGE}.cli": f"{TOOLS}.cli"}
#: above the parts: the package's public face, the entry points and the plugin itself
NOT_PARTS = {PACKAGE, MAIN, PLUGIN, f"{PACKAGE}.prepare", *ALIASES}
CALLBACKS = f"{PACKAGE}.callbacks"
CALLBACKS_MAY_IMPORT = {f"{PACKAGE}.stats", f"{PACKAGE}.modes"}


class Import(NamedTuple):
    target: str  # the module of the package the statement imports (see the module docstring)
    line: int
    from_root: bool  # ``import lightning_mp`` or ``from lightning_mp import ...``: through the package root


def package_modules(root: Path) -> dict[str, Path]:
    """Every module of the package under ``root`` (the package's folder), by dotted name; a package is its
    ``__init__.py``."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _within(name: str, package: str = PACKAGE) -> bool:
    return name == package or name.startswith(package + ".")


def imports_of(source: str, module: str, is_package: bool, modules: set[str]) -> list[Import]:
    """The imports of the package's modules in ``source`` (the text of ``module``), anywhere in the file.

    A name that is not a module of the package (a stale path) is kept as it is written, so it can be reported.
    """
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _within(alias.name):
                    found.append(Import(alias.name, node.lineno, alias.name == PACKAGE))
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source_module = ".".join(base + ([node.module] if node.module else []))
            else:
                source_module = node.module or ""
            if not _within(source_module):
                continue
            for alias in node.names:
                submodule = f"{source_module}.{alias.name}"
                target = submodule if submodule in modules else source_module
                found.append(Import(target, node.lineno, source_module == PACKAGE))
    return sorted(found, key=lambda i: i.line)


@pytest.fixture(scope="module")
def modules() -> dict[str, Path]:
    return package_modules(Path(lightning_mp.__file__).resolve().parent)


@pytest.fixture(scope="module")
def imports(modules: dict[str, Path]) -> dict[str, list[Import]]:
    names = set(modules)
    return {
        name: imports_of(path.read_text(encoding="utf-8"), name, path.name == "__init__.py", names)
        for name, path in modules.items()
    }


@pytest.fixture(scope="module")
def graph(imports: dict[str, list[Import]]) -> dict[str, dict[str, int]]:
    """module -> {imported module: line of the first such import}."""
    edges: dict[str, dict[str, int]] = {}
    for name, found in imports.items():
        targets = edges.setdefault(name, {})
        for imp in sorted(found, key=lambda i: i.line):
            targets.setdefault(imp.target, imp.line)
    return edges


def _where(modules: dict[str, Path], name: str, line: int) -> str:
    """``lightning_mp/fp8/runtime.py:53``: the file, from the package's folder, and the line."""
    root = modules[PACKAGE].parent
    return f"{modules[name].relative_to(root.parent).as_posix()}:{line}"


def strongly_connected(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one module, or a module importing itself."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, {}):
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def path_between(graph: dict[str, dict[str, int]], start: str, goal: str,
                 within: Optional[set[str]] = None) -> Optional[list[str]]:
    """A shortest import path from ``start`` to ``goal`` (breadth first), or ``None``."""
    previous: dict[str, Optional[str]] = {}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph.get(v, {})):
            if within is not None and w not in within:
                continue
            if w == goal:
                path = [w, v]
                while previous.get(v) is not None:
                    v = previous[v]
                    path.append(v)
                return path[::-1]
            if w not in previous and w != start:
                previous[w] = v
                queue.append(w)
    return None


def _unique(lines: list[str]) -> list[str]:
    return list(dict.fromkeys(lines))  # one line per statement (``from m import a, b`` gives two imports)


def _describe(graph: dict[str, dict[str, int]], modules: dict[str, Path], path: list[str]) -> str:
    return " -> ".join(
        [f"{a} ({_where(modules, a, graph[a][b])})" for a, b in zip(path, path[1:])] + [path[-1]]
    )


# ------------------------------------------------------------------------------------------------ the reader
def test_the_reader_sees_every_kind_of_import():
    names = {"lightning_mp", "lightning_mp.a", "lightning_mp.a.b", "lightning_mp.a.c", "lightning_mp.d"}
    source = """
import os
import lightning_mp
import lightning_mp.d as d
from lightning_mp import Name, a
from lightning_mp.a.b import thing

def later():
    from . import c
    from .b import other
    from .. import d

class Holder:
    def method(self):
        import lightning_mp.a.c
        from lightning_mp.gone import x
"""
    found = imports_of(source, "lightning_mp.a.c", False, names)
    assert [(i.target, i.line, i.from_root) for i in found] == [
        ("lightning_mp", 3, True),
        ("lightning_mp.d", 4, False),
        ("lightning_mp", 5, True),
        ("lightning_mp.a", 5, True),
        ("lightning_mp.a.b", 6, False),
        ("lightning_mp.a.c", 9, False),
        ("lightning_mp.a.b", 10, False),
        ("lightning_mp.d", 11, True),  # from .. import d: from the package root
        ("lightning_mp.a.c", 15, False),
        ("lightning_mp.gone", 16, False),
    ]
    # in a package's __init__, one dot is the package itself
    assert [i.target for i in imports_of("from .b import x\nfrom . import c", "lightning_mp.a", True, names)] == [
        "lightning_mp.a.b", "lightning_mp.a.c"]


def test_the_graph_holds_the_package(modules, graph):
    assert {PACKAGE, PLUGIN, MAIN, TOOLS, f"{TOOLS}.compare", f"{PACKAGE}.fp8.runtime"} <= set(modules)
    assert f"{PACKAGE}.host" in graph[PLUGIN]  # a top-level import
    assert f"{PACKAGE}.fp8.support" in graph[f"{PACKAGE}.modes"]  # an import inside a function


def test_every_import_names_a_module_of_the_package(modules, imports):
    stale = [f"{_where(modules, name, i.line)}: {i.target}" for name, found in imports.items() for i in found
             if i.target not in modules]
    assert not stale, "imports of modules the package does not have:\n" + "\n".join(stale)


# ------------------------------------------------------------------------------------------------ the rules
def test_no_import_circles(modules, graph):
    circles = []
    for component in strongly_connected(graph):
        start = component[0]
        path = path_between(graph, start, start, within=set(component))
        circles.append(f"{', '.join(component)}: {_describe(graph, modules, path)}")
    assert not circles, "import circles (imports inside functions count):\n" + "\n".join(circles)


def test_only_the_entry_points_import_the_tools(modules, imports, graph):
    allowed = {MAIN, *ALIASES}
    wrong = _unique([
        f"{_where(modules, name, i.line)} imports {i.target}"
        for name, found in imports.items() if not _within(name, TOOLS) and name not in allowed
        for i in found if _within(i.target, TOOLS)
    ])
    assert not wrong, "only __main__ and the old-path aliases may import lightning_mp.tools:\n" + "\n".join(wrong)
    # the package root must not bring the tools in, not even through a module it imports
    for tool in (m for m in modules if _within(m, TOOLS)):
        path = path_between(graph, PACKAGE, tool)
        assert path is None, f"importing lightning_mp imports {tool}: {_describe(graph, modules, path)}"


def test_the_aliases_are_thin(modules, graph):
    for old, new in ALIASES.items():
        assert set(graph[old]) == {new}, f"{old} should import {new} only, not {sorted(graph[old])}"


def test_modules_import_concrete_submodules_not_the_package_root(modules, imports):
    """``import lightning_mp`` runs the package's ``__init__``, which imports the plugin and every part: inside
    the package only the command line and the tools (built on the public API) may do it."""
    wrong = _unique([
        f"{_where(modules, name, i.line)} imports through the package root ({i.target})"
        for name, found in imports.items() if name != MAIN and not _within(name, TOOLS)
        for i in found if i.from_root
    ])
    assert not wrong, "import the concrete module (from lightning_mp.x import y) instead:\n" + "\n".join(wrong)


def test_parts_never_import_the_plugin(modules, graph):
    parts = {m for m in modules if m not in NOT_PARTS and not _within(m, TOOLS)}
    assert {f"{PACKAGE}.step", f"{PACKAGE}.master", f"{PACKAGE}.fp8.runtime", f"{CALLBACKS}.monitor"} <= parts
    wrong = []
    for part in sorted(parts):
        for above in sorted(NOT_PARTS | {m for m in modules if _within(m, TOOLS)}):
            path = path_between(graph, part, above)
            if path is not None:
                wrong.append(_describe(graph, modules, path))
    assert not wrong, "a part imports the plugin or a module above it:\n" + "\n".join(wrong)


def test_callbacks_import_only_stats_and_modes(modules, imports):
    wrong = _unique([
        f"{_where(modules, name, i.line)} imports {i.target}"
        for name, found in imports.items() if _within(name, CALLBACKS)
        for i in found if i.target not in CALLBACKS_MAY_IMPORT and not _within(i.target, CALLBACKS)
    ])
    assert not wrong, "callbacks import only lightning_mp.stats, lightning_mp.modes and their own package:\n" + (
        "\n".join(wrong))


# ------------------------------------------------------------------------------------------------ old paths
def test_old_paths_are_the_tools_modules():
    import lightning_mp.cli
    import lightning_mp.compare
    import lightning_mp.tools.cli
    import lightning_mp.tools.compare
    from lightning_mp.cli import MPLightningCLI
    from lightning_mp.compare import _PeakMemory, run_mode

    assert lightning_mp.compare is lightning_mp.tools.compare and lightning_mp.cli is lightning_mp.tools.cli
    assert MPLightningCLI is lightning_mp.tools.cli.MPLightningCLI
    assert run_mode is lightning_mp.tools.compare.run_mode and _PeakMemory is lightning_mp.tools.compare._PeakMemory
