"""The package's layers only look down: a module imports its own layer or a lower one at run time.

Every module under ``ngrammar/`` is parsed with ``ast`` (nothing is imported). Imports under
``if TYPE_CHECKING:`` are type-only and exempt; every other import counts, function-local ones
included, since they run when the function does.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "ngrammar"

# Lowest first. A module belongs to the layer of the longest prefix that names it.
LAYERS: tuple[tuple[str, ...], ...] = (
    (
        "ngrammar.config",
        "ngrammar.sampling_params",
        "ngrammar.outputs",
        "ngrammar.args",
        "ngrammar.processes",
    ),
    ("ngrammar.kernels", "ngrammar.attention"),
    ("ngrammar.model",),
    ("ngrammar.runner",),
    ("ngrammar.grammar",),
    ("ngrammar.speculative",),
    ("ngrammar.distributed",),
    ("ngrammar.engine",),
    ("ngrammar.server", "ngrammar.llm", "ngrammar"),
    ("ngrammar.cli",),
)


def layer_of(module: str) -> int:
    """The index in LAYERS of the longest prefix naming ``module``; KeyError when none does."""
    best: tuple[int, int] | None = None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (
                best is None or len(prefix) > best[0]
            ):
                best = (len(prefix), index)
    if best is None:
        raise KeyError(f"{module} is in no layer: add it to LAYERS")
    return best[1]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_only(tree: ast.Module) -> set[int]:
    """ids of the nodes under ``if TYPE_CHECKING:`` blocks."""
    nodes: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            nodes.update(id(sub) for stmt in node.body for sub in ast.walk(stmt))
    return nodes


def _target(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def runtime_imports(source: str, module: str, is_package: bool) -> Iterator[tuple[str, int]]:
    """(imported ngrammar module, line) for every import that runs outside TYPE_CHECKING."""
    tree = ast.parse(source)
    skip = _type_only(tree)
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [_target(module, is_package, node)]
        else:
            continue
        for name in names:
            if name == "ngrammar" or name.startswith("ngrammar."):
                yield name, node.lineno


def import_graph() -> dict[str, set[tuple[str, int]]]:
    return {
        module_name(p): set(runtime_imports(p.read_text(), module_name(p), p.name == "__init__.py"))
        for p in sorted(PACKAGE.rglob("*.py"))
    }


def upward_imports(graph: dict[str, set[tuple[str, int]]]) -> list[str]:
    return sorted(
        f"{src}:{line} imports {dst} (layer {layer_of(dst)} > {layer_of(src)})"
        for src, targets in graph.items()
        for dst, line in targets
        if layer_of(dst) > layer_of(src)
    )


def package_of(module: str) -> str:
    """The top-level unit: ``ngrammar.engine.sequence`` -> ``ngrammar.engine``."""
    return ".".join(module.split(".")[:2])


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def package_edges(graph: dict[str, set[tuple[str, int]]]) -> dict[str, set[str]]:
    # ngrammar/__init__ is the public facade: a submodule reaching it is Python importing parents.
    edges: dict[str, set[str]] = {}
    for src, targets in graph.items():
        if src == "ngrammar":
            continue
        for dst, _ in targets:
            if dst != "ngrammar" and package_of(dst) != package_of(src):
                edges.setdefault(package_of(src), set()).add(package_of(dst))
    return edges


def module_edges(graph: dict[str, set[tuple[str, int]]]) -> dict[str, set[str]]:
    """Module to module; ``from pkg import name`` counts as importing ``pkg`` (its __init__)."""
    return {src: {dst for dst, _ in targets if dst in graph and dst != src} for src, targets in graph.items()}


def test_every_module_has_a_layer() -> None:
    for module in import_graph():
        layer_of(module)


def missing_modules(graph: dict[str, set[tuple[str, int]]]) -> list[str]:
    """Imports of ngrammar modules that do not exist: a function-local import of a module that moved
    fails only when that function runs. (``from pkg import name`` is recorded as ``pkg``.)"""
    compiled = {p.name.split(".")[0] for p in PACKAGE.glob("_*.so")}  # C++ extensions built by make setup
    known = set(graph) | {f"ngrammar.{name}" for name in compiled}
    return sorted(
        f"{src}:{line} imports {dst}"
        for src, targets in graph.items()
        for dst, line in targets
        if dst not in known
    )


def test_every_imported_module_exists() -> None:
    assert missing_modules(import_graph()) == []


def test_a_missing_module_is_reported() -> None:
    graph = {
        "ngrammar.server.core_client": {("ngrammar.distributed.parallel", 475)},
        "ngrammar.server": set(),
    }
    assert missing_modules(graph) == ["ngrammar.server.core_client:475 imports ngrammar.distributed.parallel"]


def test_no_import_goes_up_a_layer() -> None:
    assert upward_imports(import_graph()) == []


def test_no_package_import_cycle() -> None:
    assert cycles(package_edges(import_graph())) == []


def test_no_module_import_cycle() -> None:
    graph = import_graph()
    edges = module_edges(graph)
    # A package's __init__ importing its own submodules is how re-exports work, not a cycle.
    for src in edges:
        edges[src] = {dst for dst in edges[src] if not (dst.startswith(src + ".") and src in graph)}
    assert cycles(edges) == []


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        ("from ngrammar.engine.sequence import Sequence\n", ["ngrammar.engine.sequence"]),
        ("def f():\n    import ngrammar.cli\n", ["ngrammar.cli"]),
        ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ngrammar.cli import main\n", []),
        ("from .tree import DraftTree\n", ["ngrammar.speculative.tree"]),
    ],
)
def test_the_checker_sees_runtime_and_local_imports_only(source: str, expected: list[str]) -> None:
    """The checker must be able to fail: a top-level or function-local import counts, a type-only one does not."""
    found = [name for name, _ in runtime_imports(source, "ngrammar.speculative.probe", False)]
    assert found == expected


def test_an_upward_import_is_reported() -> None:
    graph = {
        "ngrammar.speculative.shadow": {("ngrammar.engine.sequence", 27)},
        "ngrammar.engine.sequence": set(),
    }
    assert upward_imports(graph) == [
        "ngrammar.speculative.shadow:27 imports ngrammar.engine.sequence (layer 7 > 5)"
    ]


def test_a_cycle_is_reported() -> None:
    assert cycles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
