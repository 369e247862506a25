"""One error class per kind of mistake: an option string the package does not know is a ``ConfigError``
everywhere, whichever analysis, task builder, result method or figure takes it.

The option-taking parameters are found, not listed: every public function and method whose parameter
has a string default or a ``Literal[...]`` annotation takes an option there, unless the name below says
the string is something else (a site, a position, a template, free text). Each is called with a
spelling nobody accepts; the call must raise ``ConfigError`` before any work, naming the value.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from typing import Any, Callable

import pytest
import torch

import arithinterp
from arithinterp.errors import ConfigError
from arithinterp.results import Result

BAD = "no-such-option"

# Strings that are not options, each with the error class that refuses a wrong one.
NOT_OPTIONS = {
    "site": "a site (SiteError)", "input_site": "a site (SiteError)", "output_site": "a site (SiteError)",
    "positions": "a position (SiteError)", "position": "a position (SiteError)",
    "template": "a prompt template (TaskError)", "prefix": "prompt text",
    "name": "a model or folder name (ModelSpecError)", "model_name": "free text", "note": "free text",
    "description": "free text", "title": "free text", "help": "free text", "who": "free text",
    "sample": "free text", "minimum_name": "free text", "what": "free text", "fold_scheme": "free text",
    "out": "a path (OutputError)", "model": "a model spec (ModelSpecError)", "output": "a variable's name",
    "device": "a torch device (ModelSpecError)", "zoo": "a zoo model's name (ModelSpecError)",
    "plan": "a page's recorded plan, as HTML",
}
FOLDERS = {"worker.run_cell": "base"}  # the sweep's folder, where run_edge_sets' ``base`` is an option
# Records the package builds and checks itself (tasks.arithmetic, load_transcoders, load_config, every
# Result, whose load checks its fields): their constructors are not where a user spells an option.
RECORDS = {"PromptSet", "PromptPairs", "SweepConfig", "Section", "Stage", "NotEnoughData", "Analysis", "Param",
           "CausalModel", "Variable"}


def _public_callables() -> dict[str, Callable]:
    found: dict[str, Callable] = {}
    for info in pkgutil.walk_packages(arithinterp.__path__, "arithinterp."):
        module = importlib.import_module(info.name)
        for name in getattr(module, "__all__", []):
            obj = getattr(module, name, None)
            if inspect.isclass(obj):
                for attr, member in vars(obj).items():
                    if attr == "__init__" and (obj.__name__ in RECORDS or issubclass(obj, Result)):
                        continue
                    if (not attr.startswith("_") or attr == "__init__") and callable(member):
                        found.setdefault(f"{obj.__name__}.{attr}", member)
            elif callable(obj) and not inspect.isclass(obj):
                found.setdefault(f"{obj.__module__.rsplit('.', 1)[-1]}.{obj.__name__}", obj)
    return found


def _is_option(qualname: str, parameter: inspect.Parameter) -> bool:
    if parameter.name in NOT_OPTIONS or FOLDERS.get(qualname) == parameter.name:
        return False
    return isinstance(parameter.default, str) or "Literal[" in str(parameter.annotation)


CALLABLES = _public_callables()


def option_parameters() -> list[tuple[str, str]]:
    """Every (callable, parameter) pair that takes an option string."""
    pairs = []
    for qualname, fn in sorted(CALLABLES.items()):
        try:
            signature = inspect.signature(fn)
        except (TypeError, ValueError):
            continue
        pairs += [(qualname, p.name) for p in signature.parameters.values() if _is_option(qualname, p)]
    return pairs


OPTIONS = option_parameters()


@pytest.fixture(scope="module")
def world(tiny_model, tiny_digit_model, digit_tokenizer):
    """Cheap real arguments, built once, by the parameter names the option-taking callables use."""
    from test_probes import _synthetic_evaluation

    from arithinterp import causal, circuits, helix, neurons, probes
    from arithinterp.activations import collect
    from arithinterp.engine.edges import Layout
    from arithinterp.features import operand_plots, train_transcoders
    from arithinterp.tasks import arithmetic

    torch.manual_seed(0)
    prompts = arithmetic(tiny_model, "+", range(10, 14), range(20, 24))
    pairs = prompts.counterfactual(vary="a", seed=0)
    graph = circuits.EdgeGraph(Layout.of(tiny_model))
    digits = arithmetic(tiny_digit_model, a=range(100, 120), b=range(100, 110))
    evaluation = _synthetic_evaluation(digits, digit_tokenizer, torch.arange(len(digits)) % 5 == 0)
    detector = probes.ErrorDetector(layers=1, method="direct", cv=2).fit(tiny_digit_model, digits, evaluation)
    values: dict[str, Any] = dict(
        model=tiny_model, model_or_tokenizer=tiny_model, prompts=prompts, pairs=pairs, acts=torch.randn(16, 8),
        values=prompts.a, tokens=prompts.tokens, source=torch.randn(16, 8), power=torch.rand(10),
        preacts=torch.randn(16, 2), a=torch.arange(16) % 4, b=torch.arange(16) // 4, op="+",
        correct=torch.tensor([True, False, True, False]), score=torch.tensor([0.9, 0.2, 0.8, 0.4]),
        target="answer_units", components=["mlp0"], place="units", answer_token=0, graph=graph,
        edge_sets=torch.zeros(1, graph.n_edges, dtype=torch.bool), neurons={0: [0]}, site="resid_pre",
        circuit=circuits.score_edges(tiny_model, pairs, "eap", progress=False),
        table=neurons.classify(tiny_model, prompts, top_k=4, progress=False),
        transcoders=train_transcoders(tiny_model, prompts, n_features=16, k=2, steps=3, batch_size=64,
                                      progress=False),
        detector=detector, X=torch.randn(8, 4), targets=torch.randint(0, 2, (8, 1)),
        masks=torch.ones(8, 1, dtype=torch.bool), text="36+59=",
    )
    values["plots"] = operand_plots(tiny_model, prompts, values["transcoders"], progress=False)
    overrides: dict[str, dict[str, Any]] = {
        "fit.das": dict(pairs=causal.interchange_dataset(arithmetic(tiny_model, "+", range(10, 16), range(20, 26)),
                                                         "sum_mod_10", n=8, seed=0)),
        "reask.repair": dict(model=tiny_digit_model, prompts=digits),
        "layer_probes.probe_layers": dict(acts=collect(tiny_model, prompts, sites=["resid_post"], positions="last",
                                                       progress=False)),
    }
    instances: dict[str, Callable[[], Any]] = dict(
        PromptSet=lambda: prompts,
        HelixFit=lambda: helix.fit(torch.randn(40, 8), torch.arange(40), periods=(10,)),
        LogisticProbe=lambda: probes.LogisticProbe(),
        DetectorResult=lambda: detector.evaluate(tiny_digit_model, digits, evaluation),
        HeuristicTable=lambda: values["table"],
        NeuronMaps=lambda: neurons.maps(tiny_model, prompts, neurons=[(0, 0)], progress=False),
        OperandPlots=lambda: values["plots"],
    )
    fits = dict(ErrorDetector=lambda made: made.fit(tiny_digit_model, digits, evaluation))
    return dict(values=values, overrides=overrides, instances=instances, fits=fits)


def _call(world: dict, qualname: str, parameter: str) -> None:
    fn = CALLABLES[qualname]
    owner, _, method = qualname.rpartition(".")
    signature = inspect.signature(fn)
    given = {**world["values"], **world["overrides"].get(qualname, {})}
    arguments: dict[str, Any] = {}
    for p in signature.parameters.values():
        if p.name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.default is not p.empty:
            continue
        if p.name not in given:
            pytest.fail(f"{qualname}: no test value for its required parameter {p.name!r}; add one to world()")
        arguments[p.name] = given[p.name]
    arguments[parameter] = BAD
    if "self" not in signature.parameters:
        fn(**arguments)
    elif method == "__init__":  # an estimator checks its constructor's options when it is fitted
        world["fits"][owner](getattr(importlib.import_module(fn.__module__), owner)(**arguments))
    elif owner in world["instances"]:
        getattr(world["instances"][owner](), method)(**arguments)
    else:
        pytest.fail(f"{qualname}: no test instance of {owner}; add one to world()")


def test_the_options_are_found():
    found = {f"{q}({p})" for q, p in OPTIONS}
    # a few that must be there, so that a change to the discovery cannot quietly empty the list
    for expected in ("generators.arithmetic(op)", "PromptSet.counterfactual(vary)", "exact.activation_patching(metric)",
                     "fit.das(method)", "circuit.score_edges(method)",
                     "component_ablation.ablate(ablation)", "fitting.fit(kind)", "ErrorDetector.__init__(method)"):
        assert expected in found, sorted(found)
    assert len(OPTIONS) >= 60


@pytest.mark.slow
@pytest.mark.parametrize("qualname, parameter", OPTIONS, ids=[f"{q}-{p}" for q, p in OPTIONS])
def test_an_unknown_option_is_a_config_error(world, qualname, parameter):
    with pytest.raises(ConfigError, match=BAD):
        _call(world, qualname, parameter)


# Options taken without a default, found by name rather than by signature.
NAMED = {
    "cyclic.concept": lambda w: arithinterp.cyclic.concept(BAD),
    "PromptSet.with_scoring": lambda w: w["values"]["prompts"].with_scoring(BAD),
    "PromptSet.label": lambda w: w["values"]["prompts"].label(BAD),
    "probes.probe_layers(target)": lambda w: arithinterp.probes.probe_layers(
        w["overrides"]["layer_probes.probe_layers"]["acts"], BAD, progress=False),
    "load_model(dtype)": lambda w: arithinterp.load_model("zoo:add-100", dtype=BAD),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(NAMED))
def test_an_unknown_named_option_is_a_config_error(world, name):
    with pytest.raises(ConfigError, match=BAD):
        NAMED[name](world)

