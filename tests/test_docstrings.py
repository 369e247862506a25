"""Every public function documents its parameters and what it returns; every public class has a docstring.

The public names are the ones the API reference (``docs/api/``) lists (``scripts/api_docs.py``: each public module's
``__all__``, or what it defines). A function with parameters needs a Google-style ``Args:`` section
naming each of them (``self``/``cls``, ``_private`` keywords and ``*args``/``**kwargs``
passthroughs aside); a function that returns something needs ``Returns:`` (or ``Yields:``).
mkdocstrings renders those sections as the parameter tables of the API reference.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import re
import textwrap
import types

import pytest
from pathlib import Path

ROOT = Path(__file__).parent.parent

SECTION = re.compile(r"^([A-Z][A-Za-z ]*):\s*$")
ENTRY = re.compile(r"^(\*{0,2}\w+)\s*(\([^)]*\))?\s*:")
NO_VALUE = {"None", "NoReturn", "Never", "typing.NoReturn", "typing.Never"}
GENERATOR = re.compile(r"^(typing\.|collections\.abc\.)?(Iterator|Iterable|Generator|AsyncIterator|AsyncGenerator)\b")


def _api_docs():
    spec = importlib.util.spec_from_file_location("api_docs", ROOT / "scripts" / "api_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def public_objects(unimportable: list[str] | None = None) -> list[tuple[str, object]]:
    """``(dotted name, object)`` for every public function and class, each once, under the first
    module that exports it (the order of the API reference). A module that fails to import is skipped
    and named in ``unimportable`` (when given), so that the other modules are still checked."""
    api_docs = _api_docs()
    seen: set[int] = set()
    found = []
    for module_name in api_docs.public_modules():
        try:
            module = importlib.import_module(module_name)
        except Exception as error:  # noqa: BLE001 - reported with the other problems
            if unimportable is None:
                raise
            unimportable.append(f"{module_name}: cannot be imported ({type(error).__name__}: {error})")
            continue
        for name in api_docs.public_names(module):
            obj = getattr(module, name)
            if not isinstance(obj, (types.FunctionType, type)) or id(obj) in seen:
                continue
            if not getattr(obj, "__module__", "").startswith("arithinterp"):
                continue  # a re-exported name from another package (jaxtyping's shape aliases)
            seen.add(id(obj))
            found.append((f"{module_name}.{name}", obj))
    return found


def sections(doc: str) -> dict[str, list[str]]:
    """A Google-style docstring's sections: title → its lines (dedented)."""
    parsed: dict[str, list[str]] = {}
    current = None
    for line in doc.splitlines():
        match = SECTION.match(line)
        if match and not line.startswith(" "):
            current = match.group(1)
            parsed[current] = []
        elif current is not None:
            if line and not line.startswith(" "):
                current = None  # prose after a section ends it
            else:
                parsed[current].append(line)
    return {title: textwrap.dedent("\n".join(lines)).splitlines() for title, lines in parsed.items()}


def documented_parameters(doc: str) -> set[str]:
    """The names an ``Args:`` section documents (its entries at the section's own indentation)."""
    lines = sections(doc).get("Args", []) + sections(doc).get("Arguments", [])
    names = set()
    for line in lines:
        if line and not line[0].isspace():
            match = ENTRY.match(line)
            if match:
                names.add(match.group(1).lstrip("*"))
    return names


def _own_returns(function) -> tuple[bool, bool]:
    """Whether the function's own body (not nested definitions) returns a value, and whether it yields."""
    try:
        source = textwrap.dedent(inspect.getsource(function))
    except (OSError, TypeError):
        return False, False
    tree = ast.parse(source).body[0]
    returns = yields = False
    stack = list(ast.iter_child_nodes(tree))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
            continue
        if isinstance(node, ast.Return) and node.value is not None:
            if not (isinstance(node.value, ast.Constant) and node.value.value is None):
                returns = True
        if isinstance(node, (ast.Yield, ast.YieldFrom)):
            yields = True
        stack.extend(ast.iter_child_nodes(node))
    return returns, yields


def gives_back(function) -> bool:
    """Whether a function returns (or yields) a value: by its annotation, else by its body."""
    annotation = inspect.signature(function).return_annotation
    if annotation is not inspect.Signature.empty:
        text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
        return text not in NO_VALUE
    returns, yields = _own_returns(function)
    return returns or yields


def function_problems(name: str, function) -> list[str]:
    """What a public function's docstring lacks, as ``name: what`` lines."""
    function = inspect.unwrap(function)
    doc = inspect.getdoc(function)
    if not doc:
        return [f"{name}: no docstring"]
    problems = []
    wanted = [
        parameter.name
        for parameter in inspect.signature(function).parameters.values()
        if parameter.name not in ("self", "cls")
        and not parameter.name.startswith("_")  # a private keyword (``_runs``) is no public parameter
        and parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
    ]
    if wanted:
        titles = sections(doc)
        if "Args" not in titles and "Arguments" not in titles:
            problems.append(f"{name}: no Args section")
        else:
            missing = [parameter for parameter in wanted if parameter not in documented_parameters(doc)]
            if missing:
                problems.append(f"{name}: Args misses {', '.join(missing)}")
    if gives_back(function) and not {"Returns", "Return", "Yields"} & set(sections(doc)):
        problems.append(f"{name}: no Returns section")
    return problems


def class_problems(name: str, cls: type) -> list[str]:
    """What a public class lacks: a docstring of its own (not the one dataclasses generate)."""
    doc = cls.__dict__.get("__doc__")
    if not doc or not doc.strip() or doc.startswith(f"{cls.__name__}("):
        return [f"{name}: no class docstring"]
    return []


def offenders() -> list[str]:
    """Every problem of every public name, one line each."""
    problems: list[str] = []
    for name, obj in public_objects(problems):
        if isinstance(obj, type):
            problems += class_problems(name, obj)
        else:
            problems += function_problems(name, obj)
    return problems


def test_every_public_function_and_class_is_documented():
    problems = offenders()
    assert not problems, f"{len(problems)} public names lack docstring sections:\n" + "\n".join(problems)


def test_the_checker_reads_google_sections():
    def documented(model, prompts, *rest, batch_size=None, **options):
        """Does a thing.

        Args:
            model: The model.
            prompts (PromptSet): The prompts, on
                two lines.
            batch_size: Prompts per step.

        Returns:
            A number.
        """
        return 1

    def undocumented(model, layer):
        """Does a thing to ``model`` at ``layer``.

        Args:
            model: The model.
        """
        return model

    def no_value(x) -> None:
        """Nothing back.

        Args:
            x: Anything.
        """

    assert function_problems("documented", documented) == []
    assert function_problems("undocumented", undocumented) == [
        "undocumented: Args misses layer",
        "undocumented: no Returns section",
    ]
    assert function_problems("no_value", no_value) == []
    assert documented_parameters(inspect.getdoc(documented)) == {"model", "prompts", "batch_size"}


def test_griffe_reads_each_returns_section_as_one_description():
    """mkdocstrings reads ``Returns:`` as one description (``returns_multiple_items: false`` in
    mkdocs.yml); a first line like ``The :class:`X` ...`` would be split into a name ``The`` and a
    description, which the rendered table shows as a stray row label."""
    griffe = pytest.importorskip("griffe")
    problems: list[str] = []
    for name, obj in public_objects(problems):
        doc = inspect.getdoc(inspect.unwrap(obj)) if not isinstance(obj, type) else None
        if not doc:
            continue
        parsed = griffe.Docstring(doc).parse(griffe.Parser.google, returns_multiple_items=False, warnings=False)
        for section in parsed:
            if section.kind.value == "returns" and any(item.name for item in section.value):
                problems.append(f"{name}: Returns starts with a word griffe reads as a name; rephrase its first line")
    assert not problems, "\n".join(problems)
