"""The package's import layers: no import cycle and no arrow that runs up (issue 13).

Every module of ``fedml_ssfl`` is parsed with :mod:`ast`; its imports of the package (module-level
and inside functions, relative and absolute) are the arrows. Importing ``a.b.c`` also runs the
package ``a.b``'s ``__init__`` when the importer lives outside ``a.b``, so that is an arrow too.
:data:`LAYERS` is the declared order, bottom first: a module may import its own layer and the
layers below, never one above, and no set of modules may import each other round in a circle.
A new module must be given a layer here.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = "fedml_ssfl"
PACKAGE_DIR = Path(__file__).resolve().parent.parent / ROOT

LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "contract",
        (
            "fedml_ssfl.contract",
            "fedml_ssfl.errors",
            "fedml_ssfl.envvars",
            "fedml_ssfl.limits",
            "fedml_ssfl.seeding",
            "fedml_ssfl.atomic",
        ),
    ),
    (
        "pieces",
        (
            "fedml_ssfl.ssl",
            "fedml_ssfl.models",
            "fedml_ssfl.data",
            "fedml_ssfl.aggregation",
            "fedml_ssfl.sparse",
            "fedml_ssfl.sampling",
            "fedml_ssfl.participation",
            "fedml_ssfl.helper_selection",
            "fedml_ssfl.client_state",
        ),
    ),
    ("training", ("fedml_ssfl.training", "fedml_ssfl.metrics", "fedml_ssfl.stacked")),
    ("algorithms", ("fedml_ssfl.algorithms",)),
    ("config", ("fedml_ssfl.config", "fedml_ssfl.fedml_compat")),
    (
        "experiment",
        (
            "fedml_ssfl.experiment",
            "fedml_ssfl.checkpoint",
            "fedml_ssfl.trained",
            "fedml_ssfl.tracking",
            "fedml_ssfl.report",
        ),
    ),
    ("runtime", ("fedml_ssfl.runtime",)),
    ("bench", ("fedml_ssfl.bench", "fedml_ssfl.reproduction")),
    ("cli", ("fedml_ssfl.cli", "fedml_ssfl.__main__")),
]
"""Bottom first. An entry names a module, or a package and everything in it. The root package
``fedml_ssfl`` (whose ``__init__`` imports nothing) is below every layer."""


@dataclass(frozen=True)
class Arrow:
    """``source`` imports ``target`` at ``line`` (``in_function``: inside a def)."""

    source: str
    target: str
    line: int
    in_function: bool

    def __str__(self) -> str:
        where = "inside a function" if self.in_function else "at module level"
        return f"{self.source} -> {self.target} (line {self.line}, {where})"


def module_files(package_dir: Path = PACKAGE_DIR) -> dict[str, tuple[Path, bool]]:
    """Every module of the package: dotted name -> (file, is a package's ``__init__``)."""
    out = {}
    for path in sorted(package_dir.rglob("*.py")):
        parts = list(path.relative_to(package_dir.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        out[".".join(parts)] = (path, is_pkg)
    return out


def _enclosing_functions(tree: ast.AST) -> set[int]:
    """ids of the import nodes that sit inside a function body."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for sub in ast.walk(node):
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    inside.add(id(sub))
    return inside


def _nearest_module(name: str, modules: set[str]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(name: str, source: str, is_pkg: bool, modules: set[str]) -> list[Arrow]:
    """The arrows out of module ``name`` whose code is ``source`` (only into ``modules``)."""
    tree = ast.parse(source)
    inside = _enclosing_functions(tree)
    arrows: list[Arrow] = []
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join([*base, node.module] if node.module else base)
            else:
                prefix = node.module or ""
            # "from pkg import mod" imports the module; "from mod import obj" the module holding obj
            targets = [
                f"{prefix}.{alias.name}" if f"{prefix}.{alias.name}" in modules else prefix for alias in node.names
            ]
        else:
            continue
        for target in targets:
            if target != ROOT and not target.startswith(ROOT + "."):
                continue
            found = _nearest_module(target, modules)
            if found is None:
                continue
            # importing a.b.c first runs the packages a.b (unless the importer is inside it)
            chain = [found]
            parent = found.rpartition(".")[0]
            while parent and parent != ROOT:
                if not (name == parent or name.startswith(parent + ".")) and parent in modules:
                    chain.append(parent)
                parent = parent.rpartition(".")[0]
            for t in chain:
                if t != name and t != ROOT:
                    arrows.append(Arrow(name, t, node.lineno, id(node) in inside))
    return arrows


def import_graph(package_dir: Path = PACKAGE_DIR) -> list[Arrow]:
    """Every arrow between the package's modules."""
    files = module_files(package_dir)
    names = set(files)
    arrows: list[Arrow] = []
    for name, (path, is_pkg) in files.items():
        arrows += imports_of(name, path.read_text(encoding="utf-8"), is_pkg, names)
    return arrows


def layer_of(module: str, layers: list[tuple[str, tuple[str, ...]]] = LAYERS) -> int | None:
    """The index of ``module``'s layer (longest matching entry); -1 for the root; None if unassigned."""
    if module == ROOT:
        return -1
    best, best_len = None, -1
    for i, (_, entries) in enumerate(layers):
        for entry in entries:
            if (module == entry or module.startswith(entry + ".")) and len(entry) > best_len:
                best, best_len = i, len(entry)
    return best


def upward_arrows(arrows: list[Arrow], layers: list[tuple[str, tuple[str, ...]]] = LAYERS) -> list[str]:
    """Each arrow from a lower layer into a higher one, described."""
    out = []
    for a in arrows:
        src, dst = layer_of(a.source, layers), layer_of(a.target, layers)
        if src is not None and dst is not None and dst > src:
            out.append(f"{a}: layer '{layers[src][0]}' imports layer '{layers[dst][0]}'")
    return out


def cycles(arrows: list[Arrow]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for a in arrows:
        graph.setdefault(a.source, set()).add(a.target)
        graph.setdefault(a.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def _describe_cycle(component: list[str], arrows: list[Arrow]) -> str:
    inner = [str(a) for a in arrows if a.source in component and a.target in component]
    return " <-> ".join(component) + "\n      " + "\n      ".join(sorted(set(inner)))


# ---- the package ---------------------------------------------------------------------------------
def test_every_module_has_a_layer() -> None:
    missing = sorted(m for m in module_files() if layer_of(m) is None)
    assert not missing, f"give these modules a layer in tests/test_layers.py LAYERS: {missing}"


def test_no_import_cycles() -> None:
    arrows = import_graph()
    found = cycles(arrows)
    assert not found, "import cycles (function-level imports count):\n  " + "\n  ".join(
        _describe_cycle(c, arrows) for c in found
    )


def test_no_arrow_runs_up() -> None:
    bad = upward_arrows(import_graph())
    assert not bad, "imports from a higher layer (see LAYERS):\n  " + "\n  ".join(bad)


def test_training_and_metrics_build_on_the_contract_not_on_algorithms() -> None:
    arrows = [a for a in import_graph() if a.source in ("fedml_ssfl.training", "fedml_ssfl.metrics")]
    assert "fedml_ssfl.contract" in {a.target for a in arrows}
    assert not [str(a) for a in arrows if a.target.startswith("fedml_ssfl.algorithms")]
    assert not [str(a) for a in arrows if a.in_function]  # no late re-imports


# ---- the checker itself --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("source", "expect"),
    [
        ("from .algorithms.base import DataInfo", "fedml_ssfl.algorithms.base"),
        ("def f():\n    from .algorithms.base import check_finite", "fedml_ssfl.algorithms.base"),
        ("import fedml_ssfl.algorithms.base", "fedml_ssfl.algorithms.base"),
        ("from fedml_ssfl.algorithms import registry", "fedml_ssfl.algorithms.registry"),
    ],
)
def test_the_checker_sees_training_importing_algorithms(source: str, expect: str) -> None:
    modules = set(module_files())
    arrows = imports_of("fedml_ssfl.training", source, False, modules)
    assert expect in {a.target for a in arrows}
    assert "fedml_ssfl.algorithms" in {a.target for a in arrows}  # the package's __init__ runs too
    assert any("layer 'training' imports layer 'algorithms'" in s for s in upward_arrows(arrows))


def test_the_checker_finds_a_cycle_through_a_function_level_import() -> None:
    modules = set(module_files())
    arrows = imports_of("fedml_ssfl.seeding", "def f():\n    from . import atomic", False, modules)
    arrows += imports_of("fedml_ssfl.atomic", "from .seeding import generator", False, modules)
    assert cycles(arrows) == [["fedml_ssfl.atomic", "fedml_ssfl.seeding"]]
    assert not upward_arrows(arrows)  # one layer: a cycle, not an upward arrow
    relative = imports_of("fedml_ssfl.runtime.fedml.server", "from ...contract import Message", False, modules)
    assert [a.target for a in relative] == ["fedml_ssfl.contract"]
