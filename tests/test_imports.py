"""The import graph of functrain has no circle, at module level or hidden in a function body.

Every ``import`` under ``functrain/`` is read with :mod:`ast` (module level, inside functions and methods,
``importlib.import_module("functrain...")`` with a literal name), resolved to the module it runs, and the
graph of modules (a package's ``__init__`` is its own node) is checked for cycles.

How an import is resolved:

- ``import a.b.c`` and ``from a.b import c`` (``c`` a module) run ``a.b.c``, and also the ``__init__`` of
  each package above it that the importing module is not itself inside (those already ran);
- ``from a.b import name`` (``name`` not a module) runs ``a.b``; where ``a.b`` is a lazy package
  (``functrain.core.lazy`` or a module ``__getattr__`` over ``_LAZY``), ``name`` loads the module the lazy
  table names, so the edge goes there: a lazy ``__init__`` imports nothing itself, its importer does;
- imports under ``if TYPE_CHECKING:`` never run and are left out.

The layers (:data:`LAYERS`, lowest first) are checked on the imports as written: a module imports only
from its own layer or lower ones. A package ``__init__`` that an import runs on the way is left out of
that check (its own imports are checked from its own node); it is in the cycle check.
"""

from __future__ import annotations

import ast
import importlib
from collections import defaultdict
from pathlib import Path
from typing import NamedTuple

import functrain

ROOT = Path(functrain.__file__).parent
PACKAGE = "functrain"


class Edge(NamedTuple):
    target: str
    where: str  # "path:line", for the failure message
    implicit: bool  # a package __init__ that importing one of its sub-modules runs


def module_names() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, for its ``__init__``)."""
    names = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


MODULES = module_names()


def is_package(name: str) -> bool:
    return MODULES.get(name, Path()).name == "__init__.py"


def lazy_table(package: str) -> dict[str, str]:
    """A lazy package's public name -> the module defining it (its lazy sub-modules are modules)."""
    source = MODULES[package].read_text()
    if "_lazy.install" not in source and "_LAZY" not in source:
        return {}
    module = importlib.import_module(package)  # the lazy packages import nothing heavy by design
    return dict(vars(module).get("_lazy_names") or vars(module).get("_LAZY") or {})


LAZY = {name: lazy_table(name) for name in MODULES if is_package(name)}


def _ancestors(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _own_module(dotted: str) -> str | None:
    """The longest prefix of ``dotted`` that is a functrain module, or None for other packages."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        if ".".join(parts[:i]) in MODULES:
            return ".".join(parts[:i])
    return None


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_nodes(tree: ast.AST):
    """Every node of ``tree`` except those under ``if TYPE_CHECKING:`` (its ``else`` branch does run)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _targets(module: str, node: ast.AST) -> list[str]:
    """The functrain modules an import statement or ``import_module`` call runs."""
    if isinstance(node, ast.Import):
        return [t for alias in node.names if (t := _own_module(alias.name))]
    if isinstance(node, ast.ImportFrom):
        if node.level:
            base_parts = module.split(".") if is_package(module) else module.split(".")[:-1]
            base_parts = base_parts[: len(base_parts) - (node.level - 1)]
            base = ".".join(base_parts + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        owner = _own_module(base)
        if owner is None:
            return []
        names = LAZY.get(owner, {})
        found = []
        for alias in node.names:
            if f"{owner}.{alias.name}" in MODULES:
                found.append(f"{owner}.{alias.name}")  # a sub-module, lazy or not
            elif alias.name in names:
                found.extend((owner, names[alias.name]))
            else:
                found.append(owner)
        return found
    if (
        isinstance(node, ast.Call)
        and node.args
        and isinstance(node.args[0], ast.Constant)
        and isinstance(node.args[0].value, str)
        and (getattr(node.func, "attr", None) or getattr(node.func, "id", None))
        in ("import_module", "__import__")
    ):
        target = _own_module(node.args[0].value)
        return [target] if target else []
    return []


def import_graph() -> dict[str, list[Edge]]:
    """Module -> the functrain modules its code imports (when it is loaded or when its functions run)."""
    graph: dict[str, list[Edge]] = defaultdict(list)
    for module, path in MODULES.items():
        above = set(_ancestors(module)) | {module}
        for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
            for target in _targets(module, node):
                where = f"{path.relative_to(ROOT.parent)}:{node.lineno}"
                for runs in [*_ancestors(target), target]:
                    if runs not in above and runs != module:
                        graph[module].append(Edge(runs, where, runs != target))
    return graph


def cycles(graph: dict[str, list[Edge]]) -> list[list[tuple[str, str]]]:
    """One cycle per strongly connected component with more than one module, as (module, where) links."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(node: str) -> None:  # Tarjan; the graph is a few hundred nodes, recursion is fine
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for edge in graph.get(node, []):
            if edge.target not in index:
                connect(edge.target)
                low[node] = min(low[node], low[edge.target])
            elif edge.target in on_stack:
                low[node] = min(low[node], index[edge.target])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(MODULES):
        if node not in index:
            connect(node)

    found = []
    for component in components:
        start = min(component)
        # the shortest way back to start inside the component (breadth first)
        previous: dict[str, tuple[str, str]] = {}
        frontier = [start]
        while frontier and start not in previous:
            following = []
            for node in frontier:
                for edge in graph.get(node, []):
                    if edge.target in component and edge.target not in previous:
                        previous[edge.target] = (node, edge.where)
                        following.append(edge.target)
            frontier = following
        chain, node = [], start
        while True:
            before, where = previous[node]
            chain.append((before, where))
            node = before
            if node == start:
                break
        found.append(chain[::-1])
    return found


# core -> optim -> step/parallel -> compile -> services -> loop -> trainer -> cli (issue #32); a module is
# in the layer of its longest listed prefix.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "core",
        (
            "functrain",  # the package __init__: lazy names only (functrain.core.lazy)
            "functrain.core",
            "functrain._version",
            "functrain.tree",
            "functrain.random",
            "functrain.precision",
            "functrain.metrics",
        ),
    ),
    ("optim", ("functrain.optim",)),
    (
        "step/parallel",
        (
            "functrain.state",
            "functrain.step",
            "functrain.distributed",
            "functrain.remat",
            "functrain.ensemble",
        ),
    ),
    ("compile", ("functrain.jit", "functrain.compile")),
    (
        "services",
        (
            "functrain.data",
            "functrain.checkpoint",
            "functrain.logging",
            "functrain.callbacks",
            "functrain.config",
            "functrain.model_summary",
        ),
    ),
    ("loop", ("functrain.loop",)),
    ("trainer", ("functrain.trainer",)),
    ("cli", ("functrain.cli", "functrain.__main__")),
]


def layer(module: str) -> int:
    """The index in :data:`LAYERS` of ``module``'s layer."""
    matches = [
        (len(prefix), i)
        for i, (_, prefixes) in enumerate(LAYERS)
        for prefix in prefixes
        if module == prefix or module.startswith(prefix + ".")
    ]
    assert matches, f"{module} is in no layer: add it to LAYERS in {__file__}"
    return max(matches)[1]


def upward_imports(graph: dict[str, list[Edge]]) -> dict[tuple[str, str], str]:
    """``{(module, imported): "path:line"}`` of every import from a higher layer."""
    found = {}
    for module, edges in graph.items():
        for edge in edges:
            if not edge.implicit and layer(edge.target) > layer(module):
                found.setdefault((module, edge.target), edge.where)
    return found


def describe(chain: list[tuple[str, str]]) -> str:
    links = [f"{module} ({where})" for module, where in chain]
    return " -> ".join([*links, chain[0][0]])


def test_the_walk_sees_imports_inside_functions_and_lazy_names():
    graph = import_graph()
    targets = {module: {edge.target for edge in edges} for module, edges in graph.items()}
    # functrain/__init__ imports its public names lazily: the package node itself imports nothing of them
    assert "functrain.step" not in targets.get("functrain", set())
    # a lazy name of checkpoint is resolved to its defining module
    assert LAZY["functrain.checkpoint"]["CheckpointManager"] == "functrain.checkpoint.manager"
    # the walk sees function-level imports: the CLI loads the trainer only when a command runs
    assert "functrain.trainer" in targets["functrain.cli.main"]


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles (module (file:line of the import) -> ...):\n" + "\n".join(
        describe(chain) for chain in found
    )


def test_every_module_is_in_a_layer():
    for module in MODULES:
        layer(module)


def test_no_module_imports_from_a_higher_layer():
    found = upward_imports(import_graph())
    assert not found, "imports from a higher layer (LAYERS in tests/test_imports.py):\n" + "\n".join(
        f"{a} ({LAYERS[layer(a)][0]}) imports {b} ({LAYERS[layer(b)][0]}) at {where}"
        for (a, b), where in sorted(found.items())
    )
