"""The package itself: names that mean one thing, and modules that share only public names."""

import ast
import importlib
import subprocess
import sys
import types
from pathlib import Path

import pytest

import arithinterp as ai

PACKAGE = Path(ai.__file__).parent


def test_report_function_survives_importing_the_report_module():
    # the CLI imports the module arithinterp.report; the function must stay reachable and callable
    importlib.import_module("arithinterp.report")
    importlib.import_module("arithinterp.cli")
    assert isinstance(ai.report, types.ModuleType)
    assert callable(ai.write_report)
    assert ai.write_report is ai.report.write_report


@pytest.mark.slow
def test_write_report_is_the_function_in_a_fresh_interpreter():
    code = "import arithinterp as ai, arithinterp.cli; print(ai.write_report.__name__, type(ai.report).__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["write_report", "module"]


def _raised_names(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call) and isinstance(node.exc.func, ast.Name):
            names.append(node.exc.func.id)
    return names


def test_no_module_raises_the_base_error():
    offenders = [
        str(path.relative_to(PACKAGE))
        for path in sorted(PACKAGE.rglob("*.py"))
        if "ArithInterpError" in _raised_names(ast.parse(path.read_text()))
    ]
    assert offenders == []


def test_loading_something_that_is_not_a_saved_result_is_explained(tmp_path):
    from arithinterp.errors import ResultFileError
    from arithinterp.helix import HelixFit

    with pytest.raises(ResultFileError, match="is not a saved result"):
        HelixFit.load(tmp_path)
    (tmp_path / "result.json").write_text('{"type": "SpectrumResult", "fields": {}}')
    with pytest.raises(ResultFileError, match="holds a SpectrumResult, not a HelixFit"):
        HelixFit.load(tmp_path)
    assert issubclass(ResultFileError, ValueError)


def test_no_warning_category_is_ignored_wholesale(pytestconfig):
    # a blanket "ignore::UserWarning" would hide this package's own warnings (and real ones) from every test
    for entry in pytestconfig.getini("filterwarnings"):
        action, message, category, module = (entry.split(":") + ["", "", "", ""])[:4]
        if action == "ignore":
            assert message or module, f"{entry!r} hides every {category or 'warning'}; name the message or the module"


def test_modules_share_only_public_names():
    # what one module takes from another is part of the package's inner API: it must be public
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("arithinterp")):
                offenders += [
                    f"{path.relative_to(PACKAGE)}: {alias.name} from {node.module}"
                    for alias in node.names
                    if alias.name.startswith("_") and not alias.name.startswith("__")
                ]
    assert offenders == []


def test_a_loaded_model_has_the_hooked_model_surface(tiny_model):
    from arithinterp.types import HookedModel

    members = {"cfg", "tokenizer"} | {
        name for name, value in vars(HookedModel).items() if callable(value) and not name.startswith("_")
    }
    assert members == {"cfg", "tokenizer", "to_tokens", "run_with_cache"}
    # the hook methods are not in the protocol (only the engine calls them) but a model needs them
    missing = [name for name in members | {"run_with_hooks", "hooks"} if not hasattr(tiny_model, name)]
    assert missing == [] and callable(tiny_model)


SUBPACKAGES = sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py"))
PUBLIC_MODULES = sorted({p.stem for p in PACKAGE.glob("*.py") if not p.name.startswith("_")} | set(SUBPACKAGES))
# names two subpackages still share; a new clash fails, and so does one that is gone (then drop it here)
KNOWN_CLASHES: dict[str, list[str]] = {}


def test_no_two_subpackages_export_the_same_name():
    # `probes.KINDS` and `helix.KINDS`, or `patching.faithfulness` and `circuits.faithfulness`, made a reader
    # check which was meant
    assert {"circuits", "features", "causal", "engine", "viz"} <= set(SUBPACKAGES)
    exported: dict[str, list[str]] = {}
    for name in SUBPACKAGES:
        for public in importlib.import_module(f"arithinterp.{name}").__all__:
            exported.setdefault(public, []).append(name)
    assert {name: where for name, where in exported.items() if len(where) > 1} == KNOWN_CLASHES


def test_every_module_and_subpackage_is_an_attribute_of_a_fresh_import():
    # each is reached through the package's lazy attribute, whatever was imported before it; the engine
    # first, as the first thing a fresh interpreter asks for (one interpreter checks both: its start is
    # most of the cost)
    code = ("import arithinterp as ai, sys\n"
            "print(ai.engine.__name__, callable(ai.engine.run))\n"
            f"names = {PUBLIC_MODULES!r}\n"
            "lazy = [n for n in names if ai.__getattr__(n).__name__ != 'arithinterp.' + n]\n"
            "fresh = [n for n in names if getattr(ai, n).__name__ != 'arithinterp.' + n]\n"
            "print(lazy, fresh, sorted(set(names) - set(ai.__all__)))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["arithinterp.engine", "True", "[]", "[]", "[]"]


@pytest.mark.parametrize("old", ["patching.sweep", "patching.faithfulness", "patching.METHODS", "probes.sweep",
                                 "circuits.faithfulness", "circuits.circuit_faithfulness", "causal.das_sweep"])
def test_renamed_functions_have_no_old_name(old):
    # no release has had the old names, so there is no alias: one name per concept (a submodule of the
    # same name, such as patching.faithfulness, is a module, not a function)
    module, name = old.split(".")
    found = getattr(getattr(ai, module), name, None)
    assert found is None or isinstance(found, types.ModuleType)


def test_docstrings_cite_papers_not_a_file_that_is_not_there():
    root = PACKAGE.parent
    citing = [str(p.relative_to(root)) for p in sorted(PACKAGE.rglob("*.py")) + sorted((root / "docs").glob("*.md"))
              if "RECIPES §" in p.read_text()]
    assert citing == []
