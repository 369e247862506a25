"""The import graph matches the layers of docs/concepts.md: nothing imports upwards, and nothing is circular.

Every module of the package is parsed (function-local imports included); what it imports from the
package is mapped to a layer by the list in the docs, which is the only place the layers are written.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

import arithinterp as ai

PACKAGE = Path(ai.__file__).parent
DOCS = PACKAGE.parent / "docs" / "concepts.md"
ROOT = "arithinterp"


def layers_from_docs(text: str) -> list[list[str]]:
    """The layers of the "## Layers" section's text block, lowest first."""
    section = text.split("\n## Layers\n", 1)
    assert len(section) == 2, "docs/concepts.md has no '## Layers' section"
    block = re.search(r"```text\n(.*?)```", section[1], re.S)
    assert block is not None, "the '## Layers' section of docs/concepts.md has no ```text block"
    return [line.split() for line in reversed(block.group(1).splitlines()) if line.strip()]


LAYERS = layers_from_docs(DOCS.read_text())
LEVEL = {name: level for level, names in enumerate(LAYERS) for name in names}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def unit(module: str) -> str:
    """The name a module is listed under: its top-level module or subpackage (or the root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ROOT


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _Imports(ast.NodeVisitor):
    """Every import of the package a module makes, inside functions and under ``if TYPE_CHECKING:``
    too: (target module, names, line, whether only type checkers run it)."""

    def __init__(self, module: str, is_package: bool):
        self.base = module.split(".") if is_package else module.split(".")[:-1]
        self.found: list[tuple[str, list[str], int, bool]] = []
        self.type_only = False

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):  # for type checkers: counted for cycles, not for layers
            self.type_only = True
            for child in node.body:
                self.visit(child)
            self.type_only = False
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def _add(self, target: str, names: list[str], line: int) -> None:
        if target == ROOT or target.startswith(ROOT + "."):
            self.found.append((target, names, line, self.type_only))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, [], node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.base[: len(self.base) - node.level + 1]
            target = ".".join(base + ([node.module] if node.module else []))
        else:
            target = node.module or ""
        plain = []
        for alias in node.names:  # `from arithinterp import sites` imports the module arithinterp.sites
            if f"{target}.{alias.name}" in MODULES:
                self._add(f"{target}.{alias.name}", [], node.lineno)
            else:
                plain.append(alias.name)
        if plain:
            self._add(target, plain, node.lineno)


def imports_of(module: str) -> list[tuple[str, list[str], int, bool]]:
    path = MODULES[module]
    visitor = _Imports(module, path.name == "__init__.py")
    visitor.visit(ast.parse(path.read_text()))
    return visitor.found


IMPORTS = {module: imports_of(module) for module in MODULES}


def layer_problems(imports: dict, modules: dict) -> list[str]:
    """What breaks the layers: an import from a higher layer, or into a peer subpackage's module or
    private name."""
    problems = []
    for module, found in imports.items():
        for target, names, line, type_only in found:
            here, there = unit(module), unit(target)
            if here == there:
                continue
            where = f"{module} (line {line}) imports {target}"
            if LEVEL[there] > LEVEL[here]:
                if not type_only:  # an annotation may name a type from above; it never runs
                    problems.append(f"{where}: '{there}' is above '{here}'")
            elif LEVEL[there] == LEVEL[here] and f"{ROOT}.{there}" in modules \
                    and modules[f"{ROOT}.{there}"].name == "__init__.py":
                if target != f"{ROOT}.{there}":
                    problems.append(f"{where}: a module of the peer '{there}'; import its public names from "
                                    f"{ROOT}.{there}")
                else:
                    exported = _exported(there)
                    problems += [f"{where}: {name} is not in {there}.__all__" for name in names
                                 if name not in exported]
    return problems


def _exported(package: str) -> set[str]:
    tree = ast.parse(MODULES[f"{ROOT}.{package}"].read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
    return set()


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (or a module importing itself)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
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
            if len(component) > 1 or v in edges.get(v, ()):
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_docs_list_every_module_once():
    listed = [name for names in LAYERS for name in names]
    assert len(listed) == len(set(listed)), "a name is listed twice in docs/concepts.md's layers"
    units = {unit(m) for m in MODULES}
    assert units - set(listed) == set(), "add these modules to the layers in docs/concepts.md"
    assert set(listed) - units == set(), "the layers in docs/concepts.md list modules that do not exist"
    # the order the project's design gives, bottom up
    order = ["errors", "sites", "engine", "tasks", "activations", "patching", "viz", "report", "cli", ROOT]
    assert [LEVEL[name] for name in order] == sorted(LEVEL[name] for name in order)
    assert len({LEVEL[name] for name in order}) == len(order)


def test_no_module_imports_from_a_layer_above_its_own():
    assert layer_problems(IMPORTS, MODULES) == []


def test_the_module_import_graph_has_no_cycle():
    # imports at module top and inside functions count; those for type checkers only do not: the helper
    # modules of tasks and of the detector name, in annotations, the class that calls them
    edges = {module: {target for target, _, _, type_only in found if target in MODULES and not type_only}
             for module, found in IMPORTS.items()}
    assert cycles(edges) == []


def test_no_analysis_imports_viz():
    """A result draws through the registry viz fills (arithinterp.drawing), never by importing viz."""
    importers = sorted(f"{module} (line {line})" for module, found in IMPORTS.items()
                       if unit(module) not in ("viz", "report", "sweep", "cli", ROOT)
                       for target, _, line, _ in found if unit(target) == "viz")
    assert importers == []


def test_the_engine_imports_only_lower_layers():
    # the engine is what every analysis stands on: it may reach only errors, types, checks, sites, ...
    above = sorted({target for module, found in IMPORTS.items() if unit(module) == "engine"
                    for target, *_ in found if LEVEL[unit(target)] > LEVEL["engine"]})
    assert above == []


def test_the_version_needs_no_import_of_the_package_root():
    importers = sorted(module for module, found in IMPORTS.items() if module != ROOT
                       for target, *_ in found if target == ROOT)
    assert importers == []
    from arithinterp._version import __version__

    assert ai.__version__ == __version__
    # written once: the package metadata reads it from the same module
    tomllib = pytest.importorskip("tomllib" if sys.version_info >= (3, 11) else "tomli")
    pyproject = tomllib.loads((PACKAGE.parent / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"] and "version" in pyproject["project"]["dynamic"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "arithinterp._version.__version__"}


# the checker itself: each rule fires on a planted import, and stays quiet on allowed ones


def _check(module: str, source: str, name: str = "mod.py") -> list[str]:
    visitor = _Imports(module, name == "__init__.py")
    visitor.visit(ast.parse(source))
    return layer_problems({module: visitor.found}, MODULES)


def test_an_upward_import_is_found_even_inside_a_function():
    source = "def budget(model):\n    from arithinterp.activations import collect\n    return collect\n"
    assert _check("arithinterp.engine.mod", source) == [
        "arithinterp.engine.mod (line 2) imports arithinterp.activations: 'activations' is above 'engine'"]
    assert _check("arithinterp.engine.mod", "from arithinterp import __version__\n") == [
        "arithinterp.engine.mod (line 1) imports arithinterp: 'arithinterp' is above 'engine'"]
    assert _check("arithinterp.engine.mod", "from .. import tasks\n") == [
        "arithinterp.engine.mod (line 1) imports arithinterp.tasks: 'tasks' is above 'engine'"]


def test_type_only_and_downward_imports_are_allowed_and_plot_is_not_exempt():
    allowed = ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from arithinterp.tasks import PromptSet\n"
               "from arithinterp.errors import ConfigError\nfrom arithinterp import sites\n")
    assert _check("arithinterp.engine.mod", allowed) == []
    plot = "class R:\n    def plot(self):\n        from arithinterp.viz import base\n"
    assert _check("arithinterp.engine.mod", plot) == [
        "arithinterp.engine.mod (line 3) imports arithinterp.viz.base: 'viz' is above 'engine'"]


def test_a_peer_analysis_is_reached_only_through_its_public_names():
    assert _check("arithinterp.circuits.mod", "from arithinterp.patching.core import check_pairs\n") == [
        "arithinterp.circuits.mod (line 1) imports arithinterp.patching.core: a module of the peer 'patching'; "
        "import its public names from arithinterp.patching"]
    assert _check("arithinterp.circuits.mod", "from arithinterp.patching import check_pairs\n") == [
        "arithinterp.circuits.mod (line 1) imports arithinterp.patching: check_pairs is not in patching.__all__"]
    assert _check("arithinterp.causal.mod", "from arithinterp.probes import LogisticProbe\n") == []


@pytest.mark.parametrize("graph, expected", [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, []),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}, [["a", "b", "c"]]),
    ({"a": {"a"}}, [["a"]]),
])
def test_cycles_are_found(graph, expected):
    assert cycles(graph) == expected
