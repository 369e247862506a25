"""arithinterp: how does a language model do arithmetic?

A toolkit for arithmetic circuits in TransformerLens hooked models: activation patching,
linear probes and error detection, Fourier and helix fits, heuristic neurons, plots and reports.

    import arithinterp as ai
    model = ai.load_model("zoo:add-100")
    prompts = ai.tasks.arithmetic(model, "+", range(100), range(100), "{a}+{b}=")
    ai.patching.activation_patching(model, prompts.counterfactual("a"), "resid_pre")
    ai.write_report(model, out="report.html")

Submodules load on first use, so ``import arithinterp`` stays quick.
"""

import importlib
import os
from typing import TYPE_CHECKING

# Intel MKL's matrix products give the same bits on any number of threads in its strict reproducible mode,
# which it reads once, at its first product: set here, before any, so that the thread count the report
# picks from the free CPUs changes how fast it runs and never what it finds (arithinterp.report.threads)
os.environ.setdefault("MKL_CBWR", "AUTO,STRICT")

from arithinterp._version import __version__  # noqa: E402  (after the setting above)
from arithinterp.errors import ArithInterpError  # noqa: E402

if TYPE_CHECKING:  # what the lazy __getattr__ below returns, for type checkers and editors
    from arithinterp import (
        activations, causal, checks, circuits, cli, cyclic, drawing, engine, errors, features, fourier, helix,
        intervals, lens, metrics, models, neurons, outputs, patching, printing, probes, progress, report, results,
        schemas, sites, sweep, tasks, types, viz,
    )
    from arithinterp.activations import collect
    from arithinterp.models import list_zoo, load_model
    from arithinterp.report import write_report

# every public module and subpackage, reachable as an attribute (tests/test_package.py checks the list is whole)
_SUBMODULES = (
    "activations", "causal", "checks", "circuits", "cli", "cyclic", "drawing", "engine", "errors", "features",
    "fourier", "helix", "intervals", "lens", "metrics", "models", "neurons", "outputs", "patching", "printing",
    "probes", "progress", "report", "results", "schemas", "sites", "sweep", "tasks", "types", "viz",
)
# loaded on first use like the submodules: importing the package (the command line's first step) does
# not import torch, so Ctrl-C in its first second ends with one line, not a traceback
_FUNCTIONS = {"collect": "activations", "write_report": "report", "load_model": "models", "list_zoo": "models"}


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"arithinterp.{name}")
    if name in _FUNCTIONS:
        return getattr(importlib.import_module(f"arithinterp.{_FUNCTIONS[name]}"), name)
    raise AttributeError(f"module 'arithinterp' has no attribute {name!r}")


__all__ = [
    "ArithInterpError", "load_model", "list_zoo", "collect", "write_report", "__version__",
    "activations", "causal", "checks", "circuits", "cli", "cyclic", "drawing", "engine", "errors", "features",
    "fourier", "helix", "intervals", "lens", "metrics", "models", "neurons", "outputs", "patching", "printing",
    "probes", "progress", "report", "results", "schemas", "sites", "sweep", "tasks", "types", "viz",
]
