"""gpumem's layering and names, checked from the sources: ipython -> panel -> core, no cycles, one module
per name, no test-only module in the package, no module grown past one concept.

The import graph is read with ``ast`` from every ``src/gpumem/**/*.py``: imports at module level, in
functions and under ``TYPE_CHECKING``, relative imports resolved, and the string arguments of
``importlib.import_module`` / ``__import__`` and of ``sys.modules.get`` / ``sys.modules[...]`` (the
latter only for gpumem's own modules: looking up whether torch is loaded is not an import).
``from gpumem.x import y`` depends on ``gpumem.x``, and on ``gpumem.x.y`` only where that is a module.
"""

from __future__ import annotations

import ast
import fnmatch
import itertools
import sys
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SRC = REPO_ROOT / "src"
PACKAGE = "gpumem"
# What gpumem.core must never import, directly or through another gpumem module.
BANNED_IN_CORE = frozenset({"IPython", "traitlets", "ipywidgets", "bqplot", "comm", "ipykernel"})
# A module holds one concept and its name says which: the cap catches a module that took in a second one,
# not one that is long for its concept (split by concept, never by line count).
MAX_MODULE_LINES = 900
# What users import or run by name (fnmatch patterns); every other module must be reached from these.
ENTRY_POINTS = ("gpumem", "gpumem.__main__", "gpumem.testing", "gpumem.integrations", "gpumem.integrations.*")

_IMPORT_FUNCTIONS = frozenset({"importlib.import_module", "import_module", "__import__"})
# An edge is reported by its strongest import: one that runs on import beats one that runs later, or never.
_STRENGTH = ("module level", "in a function", "importlib.import_module", "sys.modules lookup", "type-checking only")


@dataclass(frozen=True)
class Import:
    """One import statement or dynamic import, as found in the importing module's source."""

    target: str  # absolute dotted name: the module imported, or the ``from`` module
    names: tuple[str, ...]  # the names of ``from target import a, b`` (empty otherwise)
    line: int
    how: str  # "module level", "in a function", "type-checking only", "importlib.import_module", ...


@dataclass
class ImportGraph:
    src_root: Path
    modules: dict[str, Path]  # dotted module name -> source file
    imports: dict[str, list[Import]]  # everything each module imports, its own package's modules or not
    edges: dict[str, dict[str, Import]]  # module -> {package module it depends on: the first import saying so}

    def where(self, module: str, imp: Import) -> str:
        return f"{self.modules[module].relative_to(self.src_root)}:{imp.line}, {imp.how}"


def _module_names(src_root: Path, package: str) -> tuple[dict[str, Path], set[str]]:
    modules: dict[str, Path] = {}
    packages: set[str] = set()
    for path in sorted((src_root / package).rglob("*.py")):
        parts = path.relative_to(src_root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
            packages.add(".".join(parts))
        modules[".".join(parts)] = path
    return modules, packages


def _dotted(node: ast.expr) -> str | None:
    """``a.b.c`` for a chain of attribute lookups on a name, else None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _string(node: ast.expr | None) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


class _Collector(ast.NodeVisitor):
    """Every import of one module, each labelled with where it happens."""

    def __init__(self, module: str, is_package: bool, package: str) -> None:
        self.module = module
        self.anchor = module if is_package else module.rpartition(".")[0]
        self.package = package
        self.found: list[Import] = []
        self._where = ["module level"]

    def _add(self, target: str, line: int, names: tuple[str, ...] = (), how: str | None = None) -> None:
        self.found.append(Import(target, names, line, how or self._where[-1]))

    def _absolute(self, name: str, level: int) -> str:
        if level == 0:
            return name
        parts = self.anchor.split(".")
        base = ".".join(parts[: len(parts) - (level - 1)])
        return f"{base}.{name}" if name else base

    def _inside(self, where: str, body: Iterable[ast.AST]) -> None:
        self._where.append(where)
        for child in body:
            self.visit(child)
        self._where.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef) -> None:
        self._inside("in a function", ast.iter_child_nodes(node))

    def visit_AsyncFunctionDef(self, node: ast.AsyncFunctionDef) -> None:
        self._inside("in a function", ast.iter_child_nodes(node))

    def visit_Lambda(self, node: ast.Lambda) -> None:
        self._inside("in a function", [node.body])

    def visit_If(self, node: ast.If) -> None:
        if (_dotted(node.test) or "").rpartition(".")[2] != "TYPE_CHECKING":
            self.generic_visit(node)
            return
        self._inside("type-checking only", node.body)
        for child in node.orelse:
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        target = self._absolute(node.module or "", node.level)
        self._add(target, node.lineno, tuple(alias.name for alias in node.names))

    def visit_Call(self, node: ast.Call) -> None:
        function = _dotted(node.func)
        name = _string(node.args[0]) if node.args else None
        if name is not None and function in _IMPORT_FUNCTIONS:
            target = self._dynamic_target(name, node)
            if target is not None:
                self._add(target, node.lineno, how="importlib.import_module")
        elif name is not None and function == "sys.modules.get" and self._own(name):
            self._add(name, node.lineno, how="sys.modules lookup")
        self.generic_visit(node)

    def visit_Subscript(self, node: ast.Subscript) -> None:
        name = _string(node.slice)
        if name is not None and _dotted(node.value) == "sys.modules" and self._own(name):
            self._add(name, node.lineno, how="sys.modules lookup")
        self.generic_visit(node)

    def _own(self, name: str) -> bool:
        return name == self.package or name.startswith(f"{self.package}.")

    def _dynamic_target(self, name: str, node: ast.Call) -> str | None:
        """``import_module(".x", package=...)`` resolved where the anchor is written out."""
        if not name.startswith("."):
            return name
        anchor_node = node.args[1] if len(node.args) > 1 else None
        anchor_node = next((k.value for k in node.keywords if k.arg == "package"), anchor_node)
        anchor = _string(anchor_node)
        if anchor is None and isinstance(anchor_node, ast.Name) and anchor_node.id in ("__package__", "__name__"):
            anchor = self.anchor if anchor_node.id == "__package__" else self.module
        if anchor is None:
            return None
        level = len(name) - len(name.lstrip("."))
        parts = anchor.split(".")
        base = ".".join(parts[: len(parts) - (level - 1)])
        rest = name[level:]
        return f"{base}.{rest}" if rest else base


def _longest_module(name: str, modules: dict[str, Path]) -> str | None:
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def _package_targets(imp: Import, modules: dict[str, Path]) -> set[str]:
    found = {_longest_module(imp.target, modules)}
    found.update(f"{imp.target}.{name}" for name in imp.names if f"{imp.target}.{name}" in modules)
    return {name for name in found if name is not None}


def build_graph(src_root: Path, package: str) -> ImportGraph:
    modules, packages = _module_names(src_root, package)
    imports: dict[str, list[Import]] = {}
    edges: dict[str, dict[str, Import]] = {}
    for module, path in modules.items():
        collector = _Collector(module, module in packages, package)
        collector.visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        imports[module] = collector.found
        edges[module] = {}
        for imp in sorted(collector.found, key=lambda imp: (_STRENGTH.index(imp.how), imp.line)):
            for target in sorted(_package_targets(imp, modules) - {module}):
                edges[module].setdefault(target, imp)
    return ImportGraph(src_root, modules, imports, edges)


def describe_path(graph: ImportGraph, path: list[str]) -> str:
    steps = [path[0]]
    steps += [f"  -> {b}   ({graph.where(a, graph.edges[a][b])})" for a, b in itertools.pairwise(path)]
    return "\n".join(steps)


def _strongly_connected(edges: dict[str, dict[str, Import]]) -> list[list[str]]:
    """Tarjan's algorithm: the groups of modules that import each other, directly or not."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in edges[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group: list[str] = []
            while not group or group[-1] != node:
                group.append(stack.pop())
            groups.append(sorted(group))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return groups


def _shortest_cycle(edges: dict[str, dict[str, Import]], start: str) -> list[str] | None:
    """The shortest import chain from ``start`` back to itself, e.g. ``[a, b, a]``."""
    parent: dict[str, str] = {}
    queue: deque[str] = deque([start])
    while queue and start not in parent:
        node = queue.popleft()
        for target in sorted(edges[node]):
            if target not in parent:
                parent[target] = node
                queue.append(target)
    if start not in parent:
        return None
    path = [start, parent[start]]
    while path[-1] != start:
        path.append(parent[path[-1]])
    return path[::-1]


def find_cycles(graph: ImportGraph) -> list[list[str]]:
    """One shortest cycle per group of mutually importing modules, e.g. ``[a, b, a]``."""
    cycles = []
    for group in _strongly_connected(graph.edges):
        if len(group) > 1:
            inside = {m: {t: i for t, i in graph.edges[m].items() if t in group} for m in group}
            cycles.append(_shortest_cycle(inside, group[0]) or group)
    return cycles


def _reached_from(graph: ImportGraph, sources: list[str], stop: set[str]) -> dict[str, list[str]]:
    """Each module reachable from ``sources``, with the shortest chain to it; ``stop`` modules are not crossed."""
    chains = {source: [source] for source in sources}
    queue: deque[str] = deque(sorted(sources))
    while queue:
        node = queue.popleft()
        if node in stop:
            continue
        for target in sorted(graph.edges[node]):
            if target not in chains:
                chains[target] = [*chains[node], target]
                queue.append(target)
    return chains


def _in_layer(module: str, layer: str) -> bool:
    return module == layer or module.startswith(f"{layer}.")


def _is_banned(name: str, banned: Iterable[str]) -> bool:
    return any(_in_layer(name, root) for root in banned)


def core_violations(graph: ImportGraph, package: str, banned: Iterable[str]) -> list[str]:
    """Front-end imports reachable from ``<package>.core``, each with the chain that leads there."""
    core = [m for m in graph.modules if _in_layer(m, f"{package}.core")]
    front_ends = {m for m in graph.modules if _in_layer(m, f"{package}.ipython") or _in_layer(m, f"{package}.panel")}
    problems = []
    for module, chain in sorted(_reached_from(graph, core, front_ends).items()):
        if module in front_ends:
            problems.append(f"{package}.core reaches the front end {module}:\n{describe_path(graph, chain)}")
            continue
        for imp in graph.imports[module]:
            if _is_banned(imp.target, banned):
                via = describe_path(graph, chain)
                problems.append(f"{via}\n  -> {imp.target}   ({graph.where(module, imp)})")
    return problems


def panel_violations(graph: ImportGraph, package: str) -> list[str]:
    panel = [m for m in graph.modules if _in_layer(m, f"{package}.panel")]
    chains = _reached_from(graph, panel, set())
    return [
        f"{package}.panel reaches {module}:\n{describe_path(graph, chain)}"
        for module, chain in sorted(chains.items())
        if _in_layer(module, f"{package}.ipython")
    ]


def _basename(module: str) -> str:
    return module.rpartition(".")[2]


def name_clashes(graph: ImportGraph) -> list[str]:
    """Modules (packages included) whose last names are the same, or the same but for a plural ``s``
    (``view`` and ``views``): a reader cannot tell from the name which of them holds what."""
    by_stem: dict[str, list[str]] = {}
    for module in graph.modules:
        by_stem.setdefault(_basename(module).removesuffix("s"), []).append(module)
    return [", ".join(sorted(group)) for _, group in sorted(by_stem.items()) if len(group) > 1]


def unreached_modules(graph: ImportGraph, entry_points: Iterable[str]) -> list[str]:
    """Modules no import chain from the entry points reaches (imports in functions and importlib strings
    count, and importing a module runs its packages' ``__init__``): code only the tests or benchmarks import,
    or nothing does. It belongs in tests/, not in the wheel."""
    sources = [m for m in graph.modules if any(fnmatch.fnmatchcase(m, entry) for entry in entry_points)]
    reached = set(_reached_from(graph, sources, set()))
    reached |= {".".join(m.split(".")[:end]) for m in reached for end in range(1, m.count(".") + 1)}
    return sorted(set(graph.modules) - reached)


# --------------------------------------------------------------------------------------------
# Self-tests: the checks below cannot pass by seeing nothing
# --------------------------------------------------------------------------------------------


def _write_package(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_graph_builder_reads_the_real_package() -> None:
    graph = build_graph(SRC, PACKAGE)
    assert len(graph.modules) >= 20
    expected = {"gpumem", "gpumem.core.monitoring.monitor", "gpumem.ipython.extension", "gpumem.panel.widget"}
    assert expected <= set(graph.modules)
    assert "gpumem.core.monitoring.monitor" in graph.edges["gpumem.ipython.extension"]
    assert "gpumem.ipython.extension" in graph.edges["gpumem"]  # a function-level import


def test_the_graph_builder_resolves_every_kind_of_import(tmp_path: Path) -> None:
    _write_package(
        tmp_path,
        {
            "pkg/__init__.py": "from . import a\n",
            "pkg/a.py": "from pkg.b import thing\nfrom pkg import c\n",
            "pkg/b.py": "def f():\n    import pkg.sub.d\n    import IPython.display\nthing = 1\n",
            "pkg/c.py": "import importlib, sys\nimportlib.import_module('pkg.e')\nsys.modules.get('pkg.sub')\n"
            "sys.modules.get('torch')\nsys.modules['pkg.b']\nimportlib.import_module('.d', package='pkg.sub')\n",
            "pkg/e.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub.d import X\n",
            "pkg/sub/__init__.py": "",
            "pkg/sub/d.py": "from ..b import thing\nfrom . import not_a_module\n",
        },
    )
    graph = build_graph(tmp_path, "pkg")
    assert {m: set(e) for m, e in graph.edges.items()} == {
        "pkg": {"pkg.a"},
        "pkg.a": {"pkg.b", "pkg.c", "pkg"},
        "pkg.b": {"pkg.sub.d"},
        "pkg.c": {"pkg.e", "pkg.sub", "pkg.b", "pkg.sub.d"},
        "pkg.e": {"pkg.sub.d"},
        "pkg.sub": set(),
        "pkg.sub.d": {"pkg.b", "pkg.sub"},
    }
    hows = {(imp.target, imp.how) for imp in graph.imports["pkg.b"]}
    assert hows == {("pkg.sub.d", "in a function"), ("IPython.display", "in a function")}
    assert ("pkg.sub.d", "type-checking only") in {(imp.target, imp.how) for imp in graph.imports["pkg.e"]}
    assert "torch" not in {imp.target for imp in graph.imports["pkg.c"]}


def test_the_checks_catch_a_cycle_and_every_layer_breach(tmp_path: Path) -> None:
    _write_package(
        tmp_path,
        {
            "pkg/__init__.py": "",
            "pkg/a.py": "from pkg.b import x\n",
            "pkg/b.py": "def f():\n    import pkg.a\n",
            "pkg/util.py": "def g():\n    from traitlets import HasTraits\n",
            "pkg/core/__init__.py": "",
            "pkg/core/x.py": "from pkg.util import g\n",
            "pkg/core/y.py": "import importlib\nimportlib.import_module('IPython.display')\n",
            "pkg/core/z.py": "from pkg.panel import w\n",
            "pkg/panel/__init__.py": "",
            "pkg/panel/w.py": "import ipywidgets\nfrom pkg.ipython.v import hook\n",
            "pkg/ipython/__init__.py": "",
            "pkg/ipython/v.py": "import IPython\n",
        },
    )
    graph = build_graph(tmp_path, "pkg")
    assert find_cycles(graph) == [["pkg.a", "pkg.b", "pkg.a"]]
    assert "pkg/b.py:2, in a function" in describe_path(graph, find_cycles(graph)[0])
    problems = core_violations(graph, "pkg", BANNED_IN_CORE)
    assert len(problems) == 4, problems
    assert any(p.startswith("pkg.core.x\n  -> pkg.util") and "-> traitlets" in p for p in problems)
    assert any(p.startswith("pkg.core.y\n  -> IPython.display") for p in problems)
    front_end = [p for p in problems if "reaches the front end pkg.panel" in p]
    assert len(front_end) == 2  # pkg.panel and pkg.panel.w
    assert all(p.endswith("(pkg/core/z.py:1, module level)") for p in front_end)
    assert not any("ipywidgets" in p or "pkg.ipython" in p for p in problems)  # the front end is not crossed
    assert panel_violations(graph, "pkg") == [
        "pkg.panel reaches pkg.ipython.v:\npkg.panel.w\n  -> pkg.ipython.v   (pkg/panel/w.py:2, module level)"
    ]


def test_a_clean_package_passes(tmp_path: Path) -> None:
    _write_package(
        tmp_path,
        {
            "pkg/__init__.py": "def f():\n    from pkg.ipython import v\n",
            "pkg/core/__init__.py": "",
            "pkg/core/x.py": "import sys\ntorch = sys.modules.get('torch')\n",
            "pkg/panel/__init__.py": "import ipywidgets\nfrom pkg.core import x\n",
            "pkg/ipython/__init__.py": "",
            "pkg/ipython/v.py": "import IPython\nfrom pkg.panel import ipywidgets\n",
        },
    )
    graph = build_graph(tmp_path, "pkg")
    assert find_cycles(graph) == []
    assert core_violations(graph, "pkg", BANNED_IN_CORE) == []
    assert panel_violations(graph, "pkg") == []


def test_the_name_and_reach_checks_catch_twins_and_stray_modules(tmp_path: Path) -> None:
    _write_package(
        tmp_path,
        {
            "pkg/__init__.py": "def f():\n    from pkg.core import view\n",
            "pkg/core/__init__.py": "",
            "pkg/core/view.py": "from pkg.core.sub import kinds\n",
            "pkg/core/kinds.py": "",
            "pkg/core/sub/__init__.py": "",
            "pkg/core/sub/kinds.py": "",
            "pkg/panel/__init__.py": "",
            "pkg/panel/views.py": "",
            "pkg/plugins/__init__.py": "",
            "pkg/plugins/a.py": "import importlib\nimportlib.import_module('pkg.core.kinds')\n",
        },
    )
    graph = build_graph(tmp_path, "pkg")
    assert name_clashes(graph) == ["pkg.core.kinds, pkg.core.sub.kinds", "pkg.core.view, pkg.panel.views"]
    unreached = ["pkg.core.kinds", "pkg.panel", "pkg.panel.views", "pkg.plugins", "pkg.plugins.a"]
    assert unreached_modules(graph, ["pkg"]) == unreached
    assert unreached_modules(graph, ["pkg", "pkg.plugins.*"]) == ["pkg.panel", "pkg.panel.views"]


# --------------------------------------------------------------------------------------------
# The rules
# --------------------------------------------------------------------------------------------


def test_no_import_cycles_among_gpumem_modules() -> None:
    graph = build_graph(SRC, PACKAGE)
    cycles = find_cycles(graph)
    assert not cycles, "import cycles:\n\n" + "\n\n".join(describe_path(graph, cycle) for cycle in cycles)


def test_core_reaches_no_front_end() -> None:
    graph = build_graph(SRC, PACKAGE)
    assert any(_in_layer(m, "gpumem.core") for m in graph.modules)
    problems = core_violations(graph, PACKAGE, BANNED_IN_CORE)
    assert not problems, "gpumem.core reaches a front end:\n\n" + "\n\n".join(problems)


def test_the_panel_does_not_import_the_ipython_layer() -> None:
    graph = build_graph(SRC, PACKAGE)
    assert any(_in_layer(m, "gpumem.panel") for m in graph.modules)
    problems = panel_violations(graph, PACKAGE)
    assert not problems, "\n\n".join(problems)


def test_no_module_holds_more_than_one_concepts_worth_of_lines() -> None:
    lengths = {path: len(path.read_text(encoding="utf-8").splitlines()) for path in (SRC / PACKAGE).rglob("*.py")}
    assert len(lengths) >= 20
    too_long = sorted(f"{path.relative_to(SRC)}: {n} lines" for path, n in lengths.items() if n > MAX_MODULE_LINES)
    assert not too_long, f"modules over {MAX_MODULE_LINES} lines (split them by concept):\n" + "\n".join(too_long)


def test_no_two_modules_share_a_name() -> None:
    graph = build_graph(SRC, PACKAGE)
    clashes = name_clashes(graph)
    assert not clashes, "modules a name cannot tell apart (rename one for what it holds):\n" + "\n".join(clashes)


def test_no_test_only_module_ships_in_the_package() -> None:
    graph = build_graph(SRC, PACKAGE)
    assert {"gpumem.testing", "gpumem.core.monitoring.monitor"} <= set(graph.modules)
    stray = unreached_modules(graph, ENTRY_POINTS)
    assert not stray, (
        f"modules no import from {', '.join(ENTRY_POINTS)} reaches (move test-only code to tests/_harness, "
        "or use it from the package):\n" + "\n".join(stray)
    )


def _toml_module() -> Any:
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib
    return pytest.importorskip("tomli")  # pragma: no cover - Python 3.10


def test_ruff_bans_the_same_packages_in_core() -> None:
    config = _toml_module().loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["ruff"]["lint"]
    assert set(config["flake8-tidy-imports"]["banned-api"]) == BANNED_IN_CORE
    core_files = [str(path.relative_to(REPO_ROOT)) for path in (SRC / PACKAGE / "core").rglob("*.py")]
    assert core_files
    for pattern, ignored in config.get("per-file-ignores", {}).items():
        if {"TID251", "TID", "ALL"} & set(ignored):
            lifted = [f for f in core_files if fnmatch.fnmatch(f, pattern)]
            assert not lifted, f"per-file-ignores {pattern!r} lifts the ban for {lifted}"
