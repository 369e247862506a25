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


def test_no_two_subpackages_export_the_same_name():
    # `probes.KINDS` and `helix.KINDS`, or `patching.sweep` and `probes.sweep`, made a reader check which was meant
    exported: dict[str, list[str]] = {}
    for name in ("engine", "fourier", "helix", "models", "neurons", "patching", "probes", "sweep", "viz"):
        for public in importlib.import_module(f"arithinterp.{name}").__all__:
            exported.setdefault(public, []).append(name)
    assert {name: where for name, where in exported.items() if len(where) > 1} == {}
    assert ai.patching.activation_patching is ai.patching.sweep  # the old name still works
    assert ai.probes.probe_layers is ai.probes.sweep


def test_docstrings_cite_papers_not_a_file_that_is_not_there():
    root = PACKAGE.parent
    citing = [str(p.relative_to(root)) for p in sorted(PACKAGE.rglob("*.py")) + sorted((root / "docs").glob("*.md"))
              if "RECIPES §" in p.read_text()]
    assert citing == []
