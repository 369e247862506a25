"""The package itself: names that mean one thing, and modules that share only public names."""

import ast
import importlib
import subprocess
import sys
import types
from pathlib import Path

import arithinterp as ai

PACKAGE = Path(ai.__file__).parent


def test_report_function_survives_importing_the_report_module():
    # the CLI imports the module arithinterp.report; the function must stay reachable and callable
    importlib.import_module("arithinterp.report")
    importlib.import_module("arithinterp.cli")
    assert isinstance(ai.report, types.ModuleType)
    assert callable(ai.write_report)
    assert ai.write_report is ai.report.write_report


def test_write_report_is_the_function_in_a_fresh_interpreter():
    code = "import arithinterp as ai, arithinterp.cli; print(ai.write_report.__name__, type(ai.report).__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["write_report", "module"]
