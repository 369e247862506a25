"""Every public function, called as a careless user would, either returns a result or raises an
``ArithInterpError`` — never another exception, never a hang.

The functions are found by walking the package (every module's ``__all__``, or its public
functions where it has none) and keeping those whose parameters are declared and enforced
(``arithinterp.types.checked``); a second test says which public functions of the analyses are not
enforced, so that a new one is covered as soon as it exists. Each is called on a tiny model with
valid arguments (by the parameter's declared class, else by its name, else its default) and
hypothesis replaces one of them by a value from :data:`BAD`: wrong types, out-of-range numbers,
empty and repeated lists, NaN and infinities, strings where numbers go and numbers where strings
go, absurd sizes. Examples are few per function and derandomised, so the suite's time stays bounded
and a failure is the same on every run.
"""

from __future__ import annotations

import importlib
import inspect
import math
import signal
import typing
import warnings
from functools import cached_property
from typing import Any, Callable

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from arithinterp.errors import ArithInterpError
from arithinterp.results import Result

#: Subpackages and modules whose public functions the fuzz walks (the CLI, the report and the sweep
#: runner are tested through their commands; the engine's kernels are called from inside the analyses).
WALKED = ("activations", "causal", "circuits", "cyclic", "features", "fourier", "helix", "lens", "models", "neurons",
          "patching", "probes", "tasks")
#: Public functions left unenforced on purpose: kernels called in inner loops (a check per call would
#: cost more than the work), and helpers that take the package's own objects only.
UNCHECKED = {
    "arithinterp.features.transcoder.topk_activations",  # per encode, inside training and graphs
    "arithinterp.tasks.operators.compute", "arithinterp.tasks.templates.render",  # per prompt
    "arithinterp.tasks.templates.answer_text", "arithinterp.tasks.templates.few_shot_prefix",
    "arithinterp.tasks.operators.operand_values", "arithinterp.tasks.templates.check_template",
    "arithinterp.tasks.templates.check_names", "arithinterp.tasks.positions.position_labels",
    "arithinterp.checks.model_id",  # in every result's build_meta; it checks its model by hand
    # one int or name each, checked by hand: they name every digit of every result
    "arithinterp.tasks.places.place_name", "arithinterp.tasks.places.place_power",
    "arithinterp.tasks.positions.predicting_position",
}
#: Counts of iterations: any size is legal (the work grows with it, behind a progress bar), so they
#: are not given the absurd sizes that other numbers are.
ITERATIONS = {"steps", "n_boot", "n_random", "n_shuffles", "max_tries", "epochs", "n_permutations", "max_iter",
              "n_draws", "restarts"}
BAD: list[Any] = [
    None, "12", "", "zz", "1GiB", [], [1.7], [-1], ["x"], [0, 0], (), {}, range(0), -3, 0, 1.5, True,
    math.nan, math.inf, -math.inf, 10**12, object(), torch.tensor([math.nan]), torch.zeros(0), torch.zeros(2, 3, 4),
]
CALL_SECONDS = 30  # a call that runs longer than this is a hang
#: Not fuzzed: a valid call reads a whole training run's checkpoints (tens of seconds per example).
NOT_FUZZED = {"arithinterp.fourier.modular.progress"}


def _public(module) -> list[Callable]:
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n, o in vars(module).items() if inspect.isfunction(o) and o.__module__ == module.__name__
                 and not n.startswith("_")]
    return [getattr(module, n) for n in names if inspect.isfunction(getattr(module, n, None))]


def public_functions() -> list[Callable]:
    seen: dict[str, Callable] = {}
    for name in WALKED:
        for fn in _public(importlib.import_module(f"arithinterp.{name}")):
            seen.setdefault(f"{fn.__module__}.{fn.__qualname__}", fn)
    return [seen[k] for k in sorted(seen)]


FUNCTIONS = public_functions()
CHECKED = [fn for fn in FUNCTIONS if getattr(fn, "__arithinterp_checked__", False)
           and f"{fn.__module__}.{fn.__qualname__}" not in NOT_FUZZED]


def test_every_public_function_declares_and_enforces_its_parameters():
    missing = [f"{fn.__module__}.{fn.__qualname__}" for fn in FUNCTIONS
               if not getattr(fn, "__arithinterp_checked__", False)
               and f"{fn.__module__}.{fn.__qualname__}" not in UNCHECKED]
    assert not missing, f"public functions without @checked: {missing}"


# --- valid arguments -------------------------------------------------------------------------------------


class World:
    """Small valid inputs, built on first use: a tiny model, its prompts and pairs, transcoders, a
    circuit, an interchange dataset."""

    def __init__(self, model, tmp_path_factory):
        self.model = model
        self.tmp = tmp_path_factory

    @cached_property
    def prompts(self):
        from arithinterp.tasks import arithmetic

        return arithmetic(self.model, "+", range(10, 16), range(20, 26))

    @cached_property
    def pairs(self):
        return self.prompts.counterfactual(vary="a", seed=0)[:6]

    @cached_property
    def transcoders(self):
        from arithinterp.features import train_transcoders

        return train_transcoders(self.model, self.prompts, n_features=16, k=2, steps=2, batch_size=64,
                                 progress=False)

    @cached_property
    def circuit(self):
        from arithinterp.circuits import score_edges

        return score_edges(self.model, self.pairs, "eap", progress=False)

    @cached_property
    def dataset(self):
        from arithinterp.causal import interchange_dataset

        return interchange_dataset(self.prompts, "sum_mod_10", n=24, seed=0)

    @cached_property
    def acts(self):
        from arithinterp.activations import collect

        return collect(self.model, self.prompts, sites=["resid_post"], layers=[0], progress=False)

    def by_class(self, annotation: Any) -> Any:
        from arithinterp.activations import Activations
        from arithinterp.causal import InterchangeDataset
        from arithinterp.circuits import Circuit
        from arithinterp.features import Transcoders
        from arithinterp.tasks import PromptPairs, PromptSet

        table = {PromptSet: "prompts", PromptPairs: "pairs", Transcoders: "transcoders", Circuit: "circuit",
                 InterchangeDataset: "dataset", Activations: "acts"}
        for cls, attribute in table.items():
            if annotation is cls or (isinstance(annotation, str) and annotation == cls.__name__):
                return getattr(self, attribute)
        return inspect.Parameter.empty

    def by_name(self, name: str) -> Any:
        cheap = dict(steps=2, n_boot=20, n_random=2, n_shuffles=4, progress=False, batch_size=8, max_tries=4,
                     n_features=16, k=2)
        if name in cheap:
            return cheap[name]
        if name in ("model", "model_or_tokenizer", "source"):
            return self.model
        if name == "prompts":
            return self.prompts
        if name == "pairs":
            return self.pairs
        if name == "tokens":
            return self.prompts.tokens[:4]
        if name == "transcoders":
            return self.transcoders
        if name == "dataset":
            return self.dataset
        if name == "circuit":
            return self.circuit
        if name == "acts":
            return self.acts
        if name in ("path", "out"):
            return self.tmp.mktemp("fuzz") / "out"
        return inspect.Parameter.empty


@pytest.fixture(scope="module")
def world(tiny_model, tmp_path_factory):
    return World(tiny_model, tmp_path_factory)


def _annotation(fn: Callable, parameter: inspect.Parameter) -> Any:
    annotation = parameter.annotation
    if isinstance(annotation, str):
        try:
            annotation = eval(annotation, {**vars(typing), **fn.__globals__})  # noqa: S307 - the package's own
        except Exception:  # a name imported for type checkers only
            pass
    return annotation


def _arguments(fn: Callable, world: World) -> dict[str, Any]:
    """Valid arguments for every parameter that has no default (and cheap ones for costly defaults)."""
    out: dict[str, Any] = {}
    for parameter in inspect.signature(fn).parameters.values():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        value = world.by_class(_annotation(fn, parameter))
        if value is inspect.Parameter.empty:
            value = world.by_name(parameter.name)
        if value is inspect.Parameter.empty and parameter.default is inspect.Parameter.empty:
            value = 1  # an unknown required parameter: any value, the call must still end well
        if value is not inspect.Parameter.empty:
            out[parameter.name] = value
    return out


class Hang(Exception):
    pass


def _alarm(signum, frame):
    raise Hang(f"a call ran past {CALL_SECONDS} s")


def _name(fn: Callable) -> str:
    return f"{fn.__module__.removeprefix('arithinterp.')}.{fn.__name__}"


FUZZED = [pytest.param(fn, id=_name(fn)) for fn in CHECKED]


@pytest.mark.parametrize("fn", FUZZED)
@settings(max_examples=6, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_a_careless_call_gives_a_result_or_an_arithinterp_error(fn, world, data, tmp_path_factory, monkeypatch):
    monkeypatch.chdir(tmp_path_factory.getbasetemp())  # a relative path a call writes lands in the test's folder
    arguments = _arguments(fn, world)
    names = [p.name for p in inspect.signature(fn).parameters.values()
             if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    name = data.draw(st.sampled_from(names), label="parameter") if names else None
    if name is not None:
        pool = [v for v in BAD if not (name in ITERATIONS and isinstance(v, int) and v >= 10**6)]
        arguments[name] = data.draw(st.sampled_from(pool), label="value")
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(CALL_SECONDS)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            result = fn(**arguments)
            if isinstance(result, Result):
                result.to_frame()
    except ArithInterpError:
        pass
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
