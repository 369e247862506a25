"""One calling convention: every public analysis reads the same way.

The analyses are found by walking the analysis subpackages (every name of their ``__all__``): a
function whose first parameter is the hooked model, or one that returns a ``Result``. The shared
vocabulary — each keyword with what it means and its default — is the table of the section "One
calling convention" of docs/concepts.md, the one place it is written; the keywords only one
analysis uses are :data:`SPECIFIC` below. A keyword outside both fails, and so does a synonym of a
shared word (:data:`SYNONYMS`: ``position`` for ``positions``, ``random_state`` for ``seed``, ...),
a shared keyword with another default, a where/how keyword that can be passed by position, an
analysis of a model whose data is not ``prompts`` / ``pairs``, and an analysis that does not
return a ``Result`` (the exceptions are listed here, each with its reason).
"""

from __future__ import annotations

import importlib
import inspect
import re
import typing
from pathlib import Path
from typing import Any, Callable

import pytest

import arithinterp as ai
from arithinterp.results import Result
from arithinterp.types import HookedModel

DOCS = Path(ai.__file__).parent.parent / "docs" / "concepts.md"
ANALYSES = ("activations", "patching", "probes", "fourier", "helix", "neurons", "circuits", "features", "causal",
            "lens")


def vocabulary_from_docs(text: str) -> dict[str, str]:
    """``{keyword: default}`` from the table of the "One calling convention" section."""
    section = text.split("\n## One calling convention\n", 1)
    assert len(section) == 2, "docs/concepts.md has no '## One calling convention' section"
    body = section[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \|[^|]*\| ([^|]*) \|$", body, re.M)
    assert rows, "the 'One calling convention' section of docs/concepts.md has no keyword table"
    return {name: default.strip() for name, default in rows}


VOCABULARY = vocabulary_from_docs(DOCS.read_text())

#: Keywords one analysis (or a few of one kind) uses, each with one meaning across the package.
SPECIFIC = {
    # what an analysis runs on besides the model and its data
    "circuit", "table", "fit", "detector", "transcoders", "evaluation", "heuristic", "components", "paths",
    "variables", "causal_model", "importance_scores", "control_acts", "graph", "edge_sets", "edges", "exact",
    "approx", "a", "b", "source", "grids", "preacts", "snapshots", "path", "resume", "estimator", "registry",
    "intervention", "where", "rows",  # a subspace, the Site it acts on (as read_pyvene gives them) and the pairs scored
    "unsealed",  # load a saved folder that carries no seal (docs/files.md)
    "plots", "role", "roles",  # transcoders' operand plots, and the operand (or the sum) a feature is read at
    "k_maps", "kv_maps", "a_values", "b_values", "op", "modulus", "importance",  # classify_maps' tensor path
    "chunk_size",  # the neurons whose seeded tie-breaks are drawn together: a unit of the result, not of memory
    "plan", "out", "few_shot", "operands", "min_agreement",  # how transcoders are trained, and where they go
    "end_to_end_steps", "end_to_end_lr", "anchor",  # the transcoders' end-to-end fine-tune
    # what is read, fitted or scored
    "target", "values", "numbers", "periods", "candidates", "features", "kind", "kinds", "band", "variable",
    "answer_tokens", "model_answer", "labels", "names", "policy", "classify",
    # how the analysis decides
    "k", "top_k", "threshold", "node_threshold", "tau", "fdr", "alpha", "confidence", "cv", "C", "lr", "n_pca",
    "holdout", "degree", "rule", "factor", "fraction", "min_cells", "max_fraction", "min_neurons", "min_test_values",
    "max_nodes", "max_feature_nodes", "n_logits", "completeness", "zero_positions", "rank_by", "accept", "budget",
    "split_period", "reference",
    "max_seconds", "reachable_only", "baselines", "per_position", "normalize", "scoring", "feed", "vary", "bottom",
    "families", "controls", "groups", "shuffle_control", "control", "extra", "value", "scale", "clamp", "template",
    "per_number", "include_final", "key", "name", "n_features", "skip", "held_out", "encoder_scale",
    "resample_until", "min_frequency", "skip_ridge", "train_skip", "distinct", "sequential", "max_fvu", "sizes", "head",
    "neuron_receivers", "base", "like", "n", "dtype", "store", "probe_kw", "kwargs", "p", "raise_above",
    # a file layout's own names (circuit-tracer's hook names and activation)
    "feature_input_hook", "feature_output_hook", "activation",
    # how much to draw or resample
    "n_boot", "n_shuffles", "n_random",
    # the fitted object an analysis of activations keeps
    "meta",
}

#: Words the convention does not use, and the shared word for what they mean.
SYNONYMS = {
    "position": "positions", "random_state": "seed", "rng": "seed", "dataset": "pairs", "prompt": "prompts",
    "tokens": "prompts", "answers": "prompts (their answers)", "mode": "ablation", "batch_sets": "batch_cells",
    "batch": "batch_size", "n_steps": "steps or ig_steps", "verbose": "progress", "memory": "max_memory",
    "acts_or_tensor": "acts", "head_ids": "heads", "units": "heads or neurons",
}

#: Keywords that say where or how an analysis runs: keyword-only, after the data and what is analysed.
KEYWORD_ONLY = ("layers", "positions", "heads", "neurons", "ablation", "seed", "progress", "max_memory", "batch_size",
                "batch_cells", "engine", "ig_steps", "steps")

#: Public functions that take the model first but are helpers, not analyses (not walked), and why.
HELPERS = {
    "activations.auto_batch_size": "a batch size for a forward",
    "patching.default_components": "the component names of a model",
    "fourier.number_tokens": "the token ids of numbers",
    "features.cache_folder": "where a model's transcoders are cached",
    "features.find_transcoders": "a model's shipped or cached transcoders, or None",
    "features.plan_transcoders": "the settings of a transcoder training run, before it runs",
    "features.train_planned": "trains and caches transcoders (a fitted object and its card, not a finding)",
}

#: Analyses of a model that do not return a Result, and why.
NOT_RESULTS = {
    "activations.collect": "collected activations are what analyses read (memory-mapped per site), not a finding",
    "probes.answer_activations": "activations at the answer's slots, read as collect's are",
    "fourier.modular_logits": "the model's logits over every (a, b) of a modular task, the input of the losses",
    "fourier.number_representations": "representations of numbers, the input of separability",
    "circuits.attribute_edges": "the lower-level edge scores behind score_edges (tensors and counts)",
    "circuits.patch_edges": "the lower-level exact edge runs behind score_edges (tensors and counts)",
    "circuits.patch_neuron_edges": "the lower-level exact neuron-edge runs (tensors and counts)",
    "circuits.run_edge_sets": "the lower-level runs behind faithfulness_curve and minimality (tensors and counts)",
    "features.feature_maps": "feature activations over the operand grid, the tensors behind feature_grids",
    "features.transcoder_fvu": "a check of transcoders on a model (variance unexplained per layer, as their card has)",
    "causal.score_subspace": "the interchange scores of one given intervention (the dict das records per baseline)",
}

#: Analyses of a model whose data is not a PromptSet or PromptPairs, and why.
OTHER_DATA = {
    "features.transcoder_fvu": "transcoders first, the prompts optional (default: the model's own task's)",
    "fourier.embedding_spectrum": "numbers: the embedding of number tokens, no prompt",
    "fourier.context_spectrum": "numbers: prompts built from each number and a template",
    "fourier.number_representations": "numbers: prompts built from each number and a template",
    "fourier.number_separability": "numbers: prompts built from each number and a template",
    "fourier.modular_logits": "no data: every (a, b) of the model's modular task",
}


def _exported_types() -> dict[str, Any]:
    """Every class the package exports, by name: what an annotation quoted for type checkers names."""
    found: dict[str, Any] = {}
    for sub in (*ANALYSES, "activations", "tasks", "engine", "models", "results", "types"):
        module = importlib.import_module(f"arithinterp.{sub}")
        names = getattr(module, "__all__", None) or [n for n in vars(module) if not n.startswith("_")]
        found.update({n: o for n in names if inspect.isclass(o := getattr(module, n, None))})
    return found


EXPORTED = _exported_types()


def _resolved(fn: Callable, annotation: Any) -> Any:
    """An annotation as the object it names: a quoted one too, with the names imported for type
    checkers only (a name nothing exports fails here rather than leaving the function unchecked)."""
    while isinstance(annotation, str):  # quoted under ``from __future__ import annotations``: quoted twice
        annotation = eval(annotation, {**vars(typing), **EXPORTED, **fn.__globals__})  # noqa: S307 - the package's
    return annotation


def _public(module) -> list[tuple[str, Callable]]:
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n, o in vars(module).items() if inspect.isfunction(o) and o.__module__ == module.__name__
                 and not n.startswith("_")]
    # the function as written (``checked`` wraps it; annotations resolve in its own module)
    return [(n, inspect.unwrap(getattr(module, n))) for n in names if inspect.isfunction(getattr(module, n, None))]


def _takes_model(fn: Callable) -> bool:
    params = list(inspect.signature(fn).parameters.values())
    if not params or params[0].name != "model":
        return False
    annotation = _resolved(fn, params[0].annotation)
    return annotation is HookedModel or annotation == "HookedModel"


def _returns_result(fn: Callable) -> bool:
    annotation = _resolved(fn, inspect.signature(fn).return_annotation)
    return isinstance(annotation, type) and issubclass(annotation, Result)


def public_analyses() -> dict[str, Callable]:
    """``{"subpackage.name": function}`` for every public analysis."""
    found: dict[str, Callable] = {}
    for sub in ANALYSES:
        for name, fn in _public(importlib.import_module(f"arithinterp.{sub}")):
            if (_takes_model(fn) or _returns_result(fn)) and f"{sub}.{name}" not in HELPERS:
                found[f"{sub}.{name}"] = fn
    return dict(sorted(found.items()))


ANALYSIS = public_analyses()
OF_A_MODEL = {name: fn for name, fn in ANALYSIS.items() if _takes_model(fn)}


def _parameters(fn: Callable) -> list[inspect.Parameter]:
    return [p for p in inspect.signature(fn).parameters.values()
            if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and not p.name.startswith("_")]


def test_the_vocabulary_is_read_from_the_docs_and_holds_the_shared_words():
    assert {"model", "prompts", "pairs", "site", "layers", "positions", "heads", "neurons", "ablation", "seed",
            "progress", "max_memory", "batch_size"} <= set(VOCABULARY)
    assert not set(VOCABULARY) & set(SYNONYMS), "a synonym is in the docs' vocabulary"
    assert not set(VOCABULARY) & SPECIFIC, "a shared word is listed as specific too"
    assert len(ANALYSIS) > 40 and "patching.activation_patching" in ANALYSIS and "causal.das" in ANALYSIS


@pytest.mark.parametrize("name", list(ANALYSIS))
def test_every_keyword_is_in_the_vocabulary(name):
    fn = ANALYSIS[name]
    wrong = []
    for p in _parameters(fn):
        if p.name in SYNONYMS:
            wrong.append(f"{p.name!r} (the convention says {SYNONYMS[p.name]!r})")
        elif p.name not in VOCABULARY and p.name not in SPECIFIC:
            wrong.append(f"{p.name!r} (not in the vocabulary of docs/concepts.md nor in SPECIFIC)")
    assert not wrong, f"{name}: " + "; ".join(wrong)


#: Shared keywords whose default is the same everywhere (the table's default column says it).
FIXED_DEFAULTS = {"layers": None, "heads": None, "neurons": None, "seed": 0, "progress": True, "max_memory": None,
                  "engine": "auto", "batch_cells": None}


@pytest.mark.parametrize("name", list(ANALYSIS))
def test_shared_keywords_have_the_shared_defaults(name):
    fn = ANALYSIS[name]
    params = {p.name: p for p in _parameters(fn)}
    wrong = [f"{key}={params[key].default!r} (the convention's default is {default!r})"
             for key, default in FIXED_DEFAULTS.items()
             if key in params and params[key].default is not inspect.Parameter.empty
             and params[key].default != default]
    if "ablation" in params:
        data = "pairs" if "pairs" in params else "prompts"
        expected = {"pairs": "resample", "prompts": "mean"}[data]
        if params["ablation"].default != expected:
            wrong.append(f"ablation={params['ablation'].default!r} (on {data} the default is {expected!r})")
    assert not wrong, f"{name}: " + "; ".join(wrong)


def test_the_docs_state_the_fixed_defaults():
    for key, default in FIXED_DEFAULTS.items():
        written = VOCABULARY[key]
        assert written == f"`{default!r}`".replace("'", '"'), \
            f"docs/concepts.md gives {key} the default {written!r}, the test {default!r}"


@pytest.mark.parametrize("name", list(OF_A_MODEL))
def test_where_and_how_are_keyword_only(name):
    fn = OF_A_MODEL[name]
    positional = [p.name for p in _parameters(fn) if p.name in KEYWORD_ONLY and p.kind != p.KEYWORD_ONLY]
    assert not positional, f"{name}: {positional} can be passed by position; put them after the '*'"


@pytest.mark.parametrize("name", list(OF_A_MODEL))
def test_the_model_comes_first_and_the_data_second(name):
    fn = OF_A_MODEL[name]
    if name in OTHER_DATA:
        return
    params = _parameters(fn)
    assert len(params) > 1 and params[1].name in ("prompts", "pairs"), \
        f"{name}: the data follows the model as 'prompts' (a PromptSet) or 'pairs' (PromptPairs or an " \
        f"InterchangeDataset), got {[p.name for p in params[:3]]}"


@pytest.mark.parametrize("name", list(OF_A_MODEL))
def test_every_analysis_of_a_model_returns_a_result(name):
    fn = OF_A_MODEL[name]
    if name in NOT_RESULTS:
        assert not _returns_result(fn), f"{name} returns a Result now: drop it from NOT_RESULTS"
        return
    annotation = _resolved(fn, inspect.signature(fn).return_annotation)
    assert _returns_result(fn), f"{name} returns {annotation!r}, not a Result subclass"


def test_the_exceptions_name_analyses_that_exist():
    for table in (NOT_RESULTS, OTHER_DATA):
        gone = sorted(set(table) - set(OF_A_MODEL))
        assert not gone, f"exceptions for functions that are not analyses of a model: {gone}"
    for name in HELPERS:
        module, function = name.split(".")
        assert _takes_model(getattr(importlib.import_module(f"arithinterp.{module}"), function)), name


def test_a_keyword_outside_the_convention_is_caught():
    """The control: a function with a synonym, a wrong default and a positional where is refused."""
    def bad(model: HookedModel, dataset, position="final", random_state=1, layers=(0,)) -> Result: ...

    names = [p.name for p in _parameters(bad)]
    assert [n for n in names if n in SYNONYMS] == ["dataset", "position", "random_state"]
    assert [n for n in names if n in KEYWORD_ONLY] == ["layers"]
    assert _takes_model(bad) and _returns_result(bad)
