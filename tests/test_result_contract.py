"""The contract every result keeps, checked on every ``Result`` subclass the package defines.

The subclasses are found by importing every module of the package and walking
``Result.__subclasses__()``, so a new result type is covered as soon as it exists (as scikit-learn's
``parametrize_with_checks`` covers every estimator). Each needs a builder below that makes a small
real instance from a tiny model; a type without one fails here, saying so. For each type:

* ``save`` then ``load`` gives an equal result: every field equal (tensors in value, dtype and shape,
  plain values in value and kind), the same ``to_frame()``;
* ``to_frame()`` is a tidy pandas DataFrame: rows, string column names, one scalar per cell, no
  row twice;
* ``plot()`` returns a plotly ``Figure`` with something drawn, before and after the round trip.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import pkgutil
from collections.abc import Callable
from functools import cached_property
from typing import Any

import numpy as np
import pandas as pd
import plotly.graph_objects as go
import pytest
import torch

import arithinterp
from arithinterp.errors import ConfigError
from arithinterp.results import Result


def result_types() -> list[type]:
    """Every ``Result`` subclass defined in the package (all of its modules imported)."""
    for module in pkgutil.walk_packages(arithinterp.__path__, "arithinterp."):
        importlib.import_module(module.name)
    found, todo = set(), [Result]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in found and sub.__module__.startswith("arithinterp."):
                found.add(sub)
                todo.append(sub)
    return sorted(found, key=lambda cls: (cls.__module__, cls.__name__))


# --- small real instances, built once per session -------------------------------------------------


class Instances:
    """Lazily built inputs shared by the builders: a tiny number-token model, its prompts and pairs."""

    def __init__(self, model, digit_model, digit_tokenizer, llama_folder, tmp_path_factory):
        self.model, self.digit_model, self.digit_tokenizer = model, digit_model, digit_tokenizer
        self.llama_folder = llama_folder
        self.tmp = tmp_path_factory
        self.built: dict[type, list[Result]] = {}

    @cached_property
    def prompts(self):
        from arithinterp.tasks import arithmetic

        return arithmetic(self.model, "+", range(10, 22), range(20, 32))  # 144 prompts, a 12 x 12 grid

    @cached_property
    def pairs(self):
        return self.prompts.counterfactual(vary="a", seed=0)[:8]

    @cached_property
    def more_pairs(self):
        """Enough pairs for every edge and no edge to be told apart (a faithfulness is then defined)."""
        return self.prompts.counterfactual(vary="a", seed=0)[:64]

    @cached_property
    def acts(self):
        from arithinterp.activations import collect

        return collect(self.model, self.prompts, sites=["resid_pre"], layers=[0, 1], positions=["a"], progress=False)

    @cached_property
    def helix_fit(self):
        from arithinterp import helix

        return helix.fit(self.acts, "a", (2, 5), n_pca=8, layer=0)

    @cached_property
    def exact(self):
        from arithinterp import patching

        return patching.activation_patching(self.model, self.pairs, "resid_pre", progress=False)

    @cached_property
    def circuit(self):
        from arithinterp import circuits

        return circuits.score_edges(self.model, self.pairs, "eap", progress=False)

    @cached_property
    def table(self):
        from arithinterp import neurons

        return neurons.classify(self.model, self.prompts, top_k=4)

    @cached_property
    def transcoders(self):
        from arithinterp import features

        return features.train_transcoders(self.model, self.prompts, n_features=16, k=2, steps=20, batch_size=64,
                                          seed=0, progress=False)

    @cached_property
    def digit_prompts(self):
        from arithinterp.tasks import arithmetic

        return arithmetic(self.digit_model, a=range(100, 140), b=range(100, 130))

    @cached_property
    def detector_inputs(self):
        """The digit model with planted "errors": the last digit is off by one on the fifth of prompts
        furthest along a random direction of the layer-1 activation (as in ``test_probes``)."""
        from test_probes import _synthetic_evaluation

        from arithinterp import probes

        prompts = self.digit_prompts

        def evaluation(idx, wrong):
            return _synthetic_evaluation(prompts[idx], self.digit_tokenizer, wrong[idx])

        everything = torch.arange(len(prompts))
        clean = evaluation(everything, torch.zeros(len(prompts), dtype=torch.bool))
        x = probes.answer_activations(self.digit_model, prompts, clean, layers=[1]).data["resid_post"][:, 0, 0]
        projection = (x - x.mean(0)) @ torch.randn(x.shape[1], generator=torch.Generator().manual_seed(1))
        wrong = projection > projection.quantile(0.8)
        order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(0))
        train, test = order[:800], order[800:]
        detector = probes.ErrorDetector(layers=1, method="direct", cv=3).fit(
            self.digit_model, prompts[train], evaluation(train, wrong))
        return detector, prompts[test], evaluation(test, wrong)


def _patch(i: Instances):
    return i.exact


def _patch_per_head(i: Instances):
    from arithinterp import patching

    return patching.activation_patching(i.model, i.pairs, "attn_z", progress=False)


def _comparison(i: Instances):
    from arithinterp import patching

    return patching.compare(i.exact, patching.attribute(i.model, i.pairs, "resid_pre", progress=False))


def _attribution(i: Instances):
    from arithinterp import patching

    return patching.attribute_sites(i.model, i.pairs, ["resid_pre", "attn_z", "mlp_post"], neurons=[0, 3],
                                    progress=False)


def _effects(i: Instances):
    from arithinterp import patching

    return patching.direct_effect(i.model, i.pairs, progress=False)


def _ablation(i: Instances):
    from arithinterp import patching

    return patching.ablate(i.model, i.prompts[:24], ["attn0", "mlp1"])


def _component_faithfulness(i: Instances):
    from arithinterp import patching

    return patching.component_faithfulness(i.model, i.prompts[:24], ["attn0", "mlp1"])


def _digit_ablation(i: Instances):
    from arithinterp import patching

    return patching.digit_ablation(i.digit_model, i.digit_prompts[:16], heads=["L0H0", "L1H2"], progress=False)


def _circuit(i: Instances):
    return i.circuit


def _faithfulness(i: Instances):
    from arithinterp import circuits

    return circuits.faithfulness_curve(i.model, i.pairs, i.circuit, sizes=[1, 4, 16], n_boot=100)


def _edge_faithfulness(i: Instances):
    from arithinterp import circuits

    return circuits.edge_faithfulness(i.model, i.more_pairs, circuits.top_n(i.circuit, 16), n_boot=100)


def _minimality(i: Instances):
    from arithinterp import circuits

    return circuits.minimality(i.model, i.more_pairs, circuits.top_n(i.circuit, 4))


def _overlap(i: Instances):
    from arithinterp import circuits

    return circuits.overlap(circuits.top_n(i.circuit, 8), circuits.top_n(i.circuit, 4))


def _digit_circuits(i: Instances):
    from arithinterp import circuits, patching

    pairs = patching.vary_digit(i.digit_prompts[:16], "units", "a", seed=0)[:4]
    return circuits.digit_circuits(i.digit_model, pairs, "eap", metric="logprob", progress=False)


def _probe(i: Instances):
    from arithinterp import probes

    return probes.probe_layers(i.acts, "a_units", cv=3, progress=False)


def _detector(i: Instances):
    detector, prompts, evaluation = i.detector_inputs
    return detector.evaluate(i.digit_model, prompts, evaluation)


def _repair(i: Instances):
    from arithinterp import probes

    detector, prompts, evaluation = i.detector_inputs
    return probes.repair(i.digit_model, prompts, detector, policy=lambda model, flagged: flagged.answer.clone(),
                         evaluation=evaluation, accept="always")


def _spectrum(i: Instances):
    from arithinterp import fourier

    return fourier.embedding_spectrum(i.model, 20, n_shuffles=19, alpha=0.1)


def _neuron_frequencies(i: Instances):
    from arithinterp import fourier
    from arithinterp.tasks import arithmetic

    prompts = arithmetic(i.model, "+", range(12), range(12))
    return fourier.neuron_clusters(i.model, prompts, layer=0, progress=False)


def _filter(i: Instances):
    from arithinterp import fourier

    return fourier.frequency_filter(i.model, i.prompts[:40], "high", site="mlp_out")


def _progress(i: Instances):
    from arithinterp import fourier
    from arithinterp.models import zoo
    from arithinterp.models.train import train

    from families import modadd_entry

    name = "modadd-5-contract"
    entry = modadd_entry(name, 5, 16, steps=20, every=10, purpose="result-contract test")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(zoo, "CHECKPOINT_DIR", i.tmp.mktemp("zoo"))
        patch.setitem(zoo.ZOO, name, entry)
        train(name, progress=False)
        return fourier.progress(name=name, rule="fraction", fraction=0.5, progress=False)


def _separability(i: Instances):
    from arithinterp import fourier

    x = i.acts.data["resid_pre"][:, 0, 0]
    return fourier.separability(x, i.prompts.a, (2, 5), cv=3)


def _separability_with_control(i: Instances):
    """With a random-init model's representations as the control (``random_init`` filled)."""
    from conftest import tiny_bridge

    from arithinterp import fourier
    from arithinterp.activations import collect

    control = collect(tiny_bridge(i.model.tokenizer, seed=7), i.prompts, sites=["resid_pre"], layers=[0],
                      positions=["a"], progress=False).data["resid_pre"][:, 0, 0]
    return fourier.separability(i.acts.data["resid_pre"][:, 0, 0], i.prompts.a, (2, 5), control=control, cv=3)


def _helix_fit(i: Instances):
    return i.helix_fit


def _fit_layers(i: Instances):
    from arithinterp import helix

    return helix.fit_layers(i.acts, "a", (2, 5), n_pca=8)


def _period_search(i: Instances):
    from arithinterp import helix

    return helix.search_periods(i.acts, "a", (2, 5, 10), sizes=[1, 2], layer=0, progress=False)


def _neuron_fit(i: Instances):
    from arithinterp import helix

    return helix.neuron_fits(i.model, i.prompts, 0, neurons=[0, 1, 2], method="lstsq", progress=False)


def _helix_patch(i: Instances):
    from arithinterp import helix

    return helix.patch_test(i.model, i.prompts.counterfactual(vary="a", seed=0)[:40], i.helix_fit, n_boot=100)


def _importance(i: Instances):
    from arithinterp import neurons

    return neurons.importance(i.model, i.pairs, top_k=4)


def _maps(i: Instances):
    from arithinterp import neurons

    return neurons.maps(i.model, i.prompts, neurons=[(0, 1), (1, 2)])


def _table(i: Instances):
    return i.table


def _heuristic_ablation(i: Instances):
    from arithinterp import neurons

    return neurons.ablate_heuristic(i.model, i.prompts[:40], i.table, ablation="zero")


def _prompt_ablation(i: Instances):
    from arithinterp import neurons

    return neurons.ablate_for_prompt(i.model, i.prompts[:20], i.table, k=(1, 2))


def _transcoders(i: Instances):
    return i.transcoders


def _graph(i: Instances):
    from arithinterp import features

    return features.attribution_graph(i.model, i.prompts[:1], i.transcoders, n_logits=2, max_nodes=10)


def _operand_plots(i: Instances):
    from arithinterp import features

    return features.operand_plots(i.model, i.prompts, i.transcoders, progress=False)


def _swap(i: Instances):
    """On zoo:add-3digit, whose digit tokens have labelled groups (the tiny model's have none)."""
    from arithinterp import features, load_model
    from arithinterp.tasks import prompts_for_pairs

    model, transcoders = load_model("zoo:add-3digit"), features.load_transcoders("zoo:add-3digit")
    values = list(range(100, 1000, 45))  # 20 values, every units digit twice
    grid = prompts_for_pairs(model, "+", [a for a in values for _ in values], [b for _ in values for b in values],
                             "{a}+{b}=", answer_digits=4)
    plots = features.operand_plots(model, grid, transcoders, progress=False)
    return features.swap_test(model, grid[::40], transcoders, plots, n_random=2, progress=False)


def _feature_grids(i: Instances):
    from arithinterp import features
    from arithinterp.tasks import arithmetic

    prompts = arithmetic(i.model, "+", range(5), range(4), "{a}+{b}=")
    return features.feature_grids(i.model, prompts, i.transcoders, 0, [0, 1], labels=["first", ""])


def _path_ablation(i: Instances):
    from arithinterp import features

    return features.path_ablation(i.model, i.prompts[:30], i.transcoders,
                                  {"first": {0: [0, 1]}, "second": {1: [2]}}, n_random=2, n_boot=50)


def _feature_intervention(i: Instances):
    from arithinterp import features

    return features.intervene(i.model, i.prompts[:12], i.transcoders, 0, [0, 1, 2], scale=0.0, positions=[-1])


def _replacement(i: Instances):
    from arithinterp import features

    return features.replacement_metrics(i.model, i.prompts[:12], i.transcoders)


def _graph_sample(i: Instances):
    from arithinterp import features

    return features.graph_sample(i.model, i.prompts[:2], i.transcoders, progress=False, n_logits=2, max_nodes=10)


def _das(i: Instances):
    from arithinterp import causal

    dataset = causal.interchange_dataset(i.prompts, "sum_mod_10", n=60, seed=0)
    return causal.das(i.model, dataset, "resid_post", 0, 2, positions="final", steps=5, progress=False)


def _das_layers(i: Instances):
    from arithinterp import causal

    dataset = causal.interchange_dataset(i.prompts, "sum_mod_10", n=60, seed=0)
    return causal.das_layers(i.model, dataset, "resid_post", layers=[0, 1], positions=["final"], k=2, steps=5,
                            progress=False)


def _readable_used(i: Instances):
    from arithinterp import causal

    return causal.readable_vs_used(i.model, i.prompts, ["sum_mod_10"], layers=[0], k=2, steps=5, n=60,
                                   progress=False)


def _logit_lens(i: Instances):
    from arithinterp.lens import logit_lens

    return logit_lens(i.model, i.prompts[:20], positions=["b", "final"], progress=False)


def _sweep_run(i: Instances):
    """A two-cell sweep (accuracy, resid_pre patching) over the tiny random Llama folder of ``conftest``."""
    from arithinterp import sweep

    task = dict(name="add", op="+", a=[0, 20], b=[0, 20], template="{a}+{b}=", limit=30)
    analyses = [dict(name="accuracy"), dict(name="patching", grid=dict(site=["resid_pre"]))]
    return sweep.run_sweep(dict(out=str(i.tmp.mktemp("sweep_out")), models=[str(i.llama_folder("number"))],
                                tasks=[task], analyses=analyses), progress=False)


BUILDERS: dict[str, Callable[[Instances], Result]] = {
    "PatchResult": _patch,
    "ComparisonResult": _comparison,
    "AttributionResult": _attribution,
    "EffectResult": _effects,
    "AblationResult": _ablation,
    "ComponentFaithfulnessResult": _component_faithfulness,
    "DigitAblationResult": _digit_ablation,
    "Circuit": _circuit,
    "FaithfulnessCurveResult": _faithfulness,
    "EdgeFaithfulnessResult": _edge_faithfulness,
    "MinimalityResult": _minimality,
    "OverlapResult": _overlap,
    "DigitCircuits": _digit_circuits,
    "ProbeResult": _probe,
    "DetectorResult": _detector,
    "RepairResult": _repair,
    "SpectrumResult": _spectrum,
    "NeuronFrequencyResult": _neuron_frequencies,
    "FilterResult": _filter,
    "ProgressResult": _progress,
    "SeparabilityResult": _separability,
    "HelixFit": _helix_fit,
    "FitLayersResult": _fit_layers,
    "PeriodSearchResult": _period_search,
    "NeuronFitResult": _neuron_fit,
    "HelixPatchResult": _helix_patch,
    "NeuronImportance": _importance,
    "NeuronMaps": _maps,
    "HeuristicTable": _table,
    "HeuristicAblationResult": _heuristic_ablation,
    "PromptAblationResult": _prompt_ablation,
    "Transcoders": _transcoders,
    "FeatureGridsResult": _feature_grids,
    "PathAblationResult": _path_ablation,
    "FeatureInterventionResult": _feature_intervention,
    "ReplacementResult": _replacement,
    "GraphSample": _graph_sample,
    "AttributionGraph": _graph,
    "OperandPlots": _operand_plots,
    "SwapResult": _swap,
    "DASResult": _das,
    "DASLayersResult": _das_layers,
    "ReadableUsedResult": _readable_used,
    "SweepRun": _sweep_run,
    "LogitLensResult": _logit_lens,
}

# further instances that fill the optional fields the first leaves empty
MORE_BUILDERS: dict[str, tuple[Callable[[Instances], Result], ...]] = {
    "PatchResult": (_patch_per_head,),
    "SeparabilityResult": (_separability_with_control,),
}


# --- the checks ----------------------------------------------------------------------------------

RESULT_TYPES = result_types()


@pytest.fixture(scope="session")
def instances(tiny_model, tiny_digit_model, digit_tokenizer, llama_folder, tmp_path_factory):
    return Instances(tiny_model, tiny_digit_model, digit_tokenizer, llama_folder, tmp_path_factory)


def examples(cls: type, instances: Instances) -> list[Result]:
    """The instances of ``cls`` the checks run on: its builder's, then those of ``MORE_BUILDERS``."""
    if cls not in instances.built:
        builder = BUILDERS.get(cls.__name__)
        if builder is None:
            pytest.fail(f"{cls.__module__}.{cls.__name__} is a Result with no example builder: add one to BUILDERS in "
                        f"{__file__} that makes a small real {cls.__name__}, so the result contract is checked on it")
        made = [make(instances) for make in (builder, *MORE_BUILDERS.get(cls.__name__, ()))]
        for result in made:
            assert type(result) is cls, f"the builder for {cls.__name__} made a {type(result).__name__}"
        instances.built[cls] = made
    return instances.built[cls]


def build(cls: type, instances: Instances) -> Result:
    return examples(cls, instances)[0]


def same(a, b, where: str = "") -> None:
    """Assert ``a`` and ``b`` are equal in value and kind (NaN equals NaN; tensors in dtype and shape)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{where}: a tensor came back as a {type(b).__name__}"
        assert (a.dtype, tuple(a.shape)) == (b.dtype, tuple(b.shape)), \
            f"{where}: {a.dtype} {tuple(a.shape)} came back as {b.dtype} {tuple(b.shape)}"
        assert torch.equal(a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan()) \
            if a.is_floating_point() else torch.equal(a, b), f"{where}: tensor values changed"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b), f"{where}: keys {list(a)} came back as {list(b)}"
        for key in a:
            same(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b), f"{where}: a {type(a).__name__} came back as a {type(b).__name__}"
        assert len(a) == len(b), f"{where}: {len(a)} items came back as {len(b)}"
        for k, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{k}]")
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b), f"{where}: NaN came back as {b!r}"
    elif isinstance(a, Result):
        assert type(a) is type(b), f"{where}: a {type(a).__name__} came back as a {type(b).__name__}"
        for field in dataclasses.fields(a):
            if not field.compare:  # not part of the result's equality (e.g. code that is not saved)
                continue
            same(getattr(a, field.name), getattr(b, field.name), f"{where}.{field.name}")
    else:
        assert type(a) is type(b) and a == b, f"{where}: {a!r} came back as {b!r}"


def check_tidy(frame, name: str) -> None:
    assert isinstance(frame, pd.DataFrame), f"{name}.to_frame() returned a {type(frame).__name__}"
    assert len(frame) > 0 and len(frame.columns) > 0, f"{name}.to_frame() is empty"
    assert all(isinstance(c, str) for c in frame.columns), f"{name}.to_frame() has non-string columns"
    assert not isinstance(frame.columns, pd.MultiIndex) and frame.columns.is_unique
    for column in frame.columns:
        for value in frame[column]:
            assert value is None or isinstance(value, (str, bool, int, float, np.generic, pd.Timestamp)), \
                f"{name}.to_frame() column {column!r} holds a {type(value).__name__} ({value!r:.80}): one scalar a cell"
    assert not frame.duplicated().any(), f"{name}.to_frame() repeats a row: each row should be one observation"


@pytest.mark.parametrize("cls", RESULT_TYPES, ids=lambda cls: cls.__name__)
def test_save_then_load_gives_an_equal_result(cls, instances, tmp_path):
    for k, result in enumerate(examples(cls, instances)):
        loaded = cls.load(result.save(tmp_path / f"{cls.__name__}{k}"))
        same(result, loaded, cls.__name__)
        pd.testing.assert_frame_equal(result.to_frame(), loaded.to_frame())


@pytest.mark.parametrize("cls", RESULT_TYPES, ids=lambda cls: cls.__name__)
def test_to_frame_is_tidy(cls, instances):
    for result in examples(cls, instances):
        check_tidy(result.to_frame(), cls.__name__)


@pytest.mark.parametrize("cls", RESULT_TYPES, ids=lambda cls: cls.__name__)
def test_plot_returns_a_figure(cls, instances, tmp_path):
    for k, result in enumerate(examples(cls, instances)):
        figure = result.plot()
        assert isinstance(figure, go.Figure), f"{cls.__name__}.plot() returned a {type(figure).__name__}"
        assert len(tuple(figure.data)) > 0, f"{cls.__name__}.plot() draws nothing"
        loaded = cls.load(result.save(tmp_path / f"{cls.__name__}{k}"))
        assert isinstance(loaded.plot(), go.Figure)


def well_formed_html(page: str) -> list[str]:
    """The tags of ``page`` that open without closing, close without opening or close out of order
    (void elements such as ``<br>`` need no closing tag)."""
    from html.parser import HTMLParser

    void = {"br", "hr", "img", "meta", "input", "col", "wbr"}
    problems: list[str] = []
    stack: list[str] = []

    class Checker(HTMLParser):
        def handle_starttag(self, tag, attrs):
            if tag not in void:
                stack.append(tag)

        def handle_endtag(self, tag):
            if not stack or stack[-1] != tag:
                problems.append(f"</{tag}> closes {stack[-1] if stack else 'nothing'}")
            else:
                stack.pop()

    Checker().feed(page)
    return problems + [f"<{tag}> never closed" for tag in stack]


@pytest.mark.parametrize("cls", RESULT_TYPES, ids=lambda cls: cls.__name__)
def test_every_result_prints_briefly_and_as_an_html_table(cls, instances):
    """``repr`` is a few hundred characters, never the tensors; ``_repr_html_`` is one well-formed table
    naming the type, its tensors' shapes, its frame's size and its first rows."""
    from arithinterp.printing import MAX_REPR

    for result in examples(cls, instances):
        text = repr(result)
        assert text.startswith(f"{cls.__name__}(") and len(text) <= MAX_REPR, f"{cls.__name__} repr: {text[:500]}"
        page = result._repr_html_()
        assert not well_formed_html(page), f"{cls.__name__}._repr_html_(): {well_formed_html(page)}"
        assert page.startswith("<table") and page.endswith("</table>") and f"<b>{cls.__name__}</b>" in page
        frame = result.to_frame()
        assert f"{len(frame)} rows × {len(frame.columns)} columns" in page
        assert str(frame.columns[0]) in page  # the first rows' header
        for field in dataclasses.fields(result):
            value = getattr(result, field.name)
            if isinstance(value, torch.Tensor):
                assert f"[{', '.join(map(str, value.shape))}]" in page, f"{cls.__name__}: {field.name}'s shape"


def test_the_html_check_catches_a_broken_table():
    assert well_formed_html("<table><tr><td>1</td></tr></table><br>") == []
    assert well_formed_html("<table><tr><td>1</tr></table>") != []
    assert well_formed_html("<table><tr><td>1</td></tr>") == ["<table> never closed"]


def test_every_result_type_has_a_builder_and_every_builder_a_type():
    names = {cls.__name__ for cls in RESULT_TYPES}
    assert {"PatchResult", "Circuit", "HelixFit", "ProbeResult", "DASResult", "AttributionGraph", "SweepRun"} <= names
    assert len(names) == len(RESULT_TYPES), "two Result subclasses share a name: saved files could not tell them apart"
    assert set(BUILDERS) <= names, f"builders for types that no longer exist: {sorted(set(BUILDERS) - names)}"



def test_result_declares_the_contract_and_every_type_keeps_it():
    import inspect

    assert Result.__abstractmethods__ == frozenset({"to_frame", "plot"})
    assert [cls.__name__ for cls in RESULT_TYPES if inspect.isabstract(cls)] == []

    @dataclasses.dataclass(frozen=True)
    class NoPlot(Result):
        value: int

        def to_frame(self):
            return pd.DataFrame({"value": [self.value]})

    with pytest.raises(TypeError, match="abstract method plot"):
        NoPlot(1)  # pyright: ignore[reportAbstractUsage]


# --- older folders ---------------------------------------------------------------------------------


def _rewrite(folder, change: Callable[[dict], None]) -> None:
    """Edit a saved folder's JSON into one an earlier version wrote: those carry no seal (no digest of the
    tensor file in the JSON, no record of the JSON in the tensor file's header)."""
    import json

    from safetensors.torch import load_file, save_file

    from arithinterp.results import DIGEST_KEY

    stored = json.loads((folder / "result.json").read_text())
    stored.pop(DIGEST_KEY)
    change(stored)
    (folder / "result.json").write_text(json.dumps(stored))
    save_file(load_file(str(folder / "tensors.safetensors")), str(folder / "tensors.safetensors"))


def _load_unsealed(cls, folder):
    """An earlier version's folder: refused as it is, loaded (with a warning) when asked."""
    from arithinterp.errors import ResultFileError
    from arithinterp.results import UnsealedResultWarning

    with pytest.raises(ResultFileError, match="is not sealed"):
        cls.load(folder)
    with pytest.warns(UnsealedResultWarning, match="is not sealed"):
        return cls.load(folder, unsealed=True)


@pytest.mark.parametrize("cls", RESULT_TYPES, ids=lambda cls: cls.__name__)
def test_a_folder_saved_before_the_format_field_existed_loads(cls, instances, tmp_path):
    result = build(cls, instances)
    folder = result.save(tmp_path / cls.__name__)
    _rewrite(folder, lambda stored: stored.pop("format"))
    same(result, _load_unsealed(cls, folder), cls.__name__)


def _defaulted(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls)
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING]


@pytest.mark.parametrize("cls", [cls for cls in RESULT_TYPES if _defaulted(cls)], ids=lambda cls: cls.__name__)
def test_a_folder_saved_before_its_defaulted_fields_existed_loads_and_draws(cls, instances, tmp_path):
    """Fields with a default are the ones a type gained after its first release: a folder without
    them loads with the defaults, and its frame and figure still come out."""
    from safetensors.torch import load_file, save_file

    fullest = examples(cls, instances)[-1]
    folder = fullest.save(tmp_path / cls.__name__)
    names = {f.name for f in _defaulted(cls)}

    def drop(stored: dict) -> None:
        for name in names:
            stored["fields"].pop(name, None)

    _rewrite(folder, drop)
    tensors = load_file(str(folder / "tensors.safetensors"))
    save_file({k: v for k, v in tensors.items() if k not in names}, str(folder / "tensors.safetensors"))
    loaded = _load_unsealed(cls, folder)
    for field in _defaulted(cls):
        default = field.default if field.default is not dataclasses.MISSING else field.default_factory()  # type: ignore[misc]
        same(default, getattr(loaded, field.name), f"{cls.__name__}.{field.name}")
    check_tidy(loaded.to_frame(), cls.__name__)
    assert isinstance(loaded.plot(), go.Figure)


def test_the_checks_catch_a_lossy_save_and_an_untidy_frame(instances):
    """Controls for the checks above: a changed dtype, a changed value, a tuple read back as a list and
    a list in a frame cell are each caught."""
    result: Any = build(arithinterp.patching.PatchResult, instances)
    for changed in (dataclasses.replace(result, values=result.values.double()),
                    dataclasses.replace(result, mean=result.mean + 1e-6),
                    dataclasses.replace(result, layers=tuple(result.layers)),
                    dataclasses.replace(result, meta={**result.meta, "n_pairs": float(result.meta["n_pairs"])})):
        with pytest.raises(AssertionError):
            same(changed, result, "PatchResult")
    frame = result.to_frame()
    check_tidy(frame, "PatchResult")
    with pytest.raises(AssertionError, match="repeats a row"):
        check_tidy(pd.concat([frame, frame.iloc[:1]]), "PatchResult")
    frame["cells"] = [[1, 2]] * len(frame)
    with pytest.raises(AssertionError, match="column 'cells' holds a list"):
        check_tidy(frame, "PatchResult")


def test_the_further_instances_fill_the_fields_they_are_for(instances):
    patch: Any = examples(arithinterp.patching.PatchResult, instances)[1]
    separability: Any = examples(arithinterp.fourier.SeparabilityResult, instances)[1]
    assert patch.heads != [] and separability.random_init is not None


# --- the figure builders -------------------------------------------------------------------------

VIZ_MODULES = ["causal", "circuits", "features", "fourier", "lens", "neurons", "patching", "probes", "sweep"]


def _viz_functions():
    import inspect

    for name in VIZ_MODULES:
        module = importlib.import_module(f"arithinterp.viz.{name}")
        for attr, value in vars(module).items():
            if inspect.isfunction(value) and value.__module__ == module.__name__ and not attr.startswith("_"):
                yield module, attr, value


def test_viz_functions_share_one_name_style_and_take_the_result_types():
    """Every figure builder is ``plot_<what>``; one drawing a result says which result type it takes
    (the sweep's builders take the sweep's tidy tables)."""
    import inspect

    names = {cls.__name__ for cls in RESULT_TYPES}
    helpers = {("sweep", "cell_labels")}  # labels, not a figure
    typed = set()
    for module, attr, function in _viz_functions():
        short = module.__name__.rsplit(".", 1)[1]
        if (short, attr) in helpers:
            continue
        assert attr.startswith("plot_"), f"{module.__name__}.{attr}: figure builders are named plot_<what>"
        first = next(iter(inspect.signature(function).parameters.values()))
        annotation = str(first.annotation)
        if short == "sweep" or annotation == "pd.DataFrame":
            continue
        assert annotation in names, f"{module.__name__}.{attr}({first.name}: {annotation}) should take a result type"
        typed.add(annotation)
    drawn_otherwise = {"SweepRun", "OperandPlots"}  # the sweep's tables; the FeatureGridsResult of some features
    assert names - typed == drawn_otherwise


def test_every_result_below_viz_draws_through_the_registry():
    """The viz module :func:`arithinterp.drawing.draw` loads for a result type registers its drawer, so
    ``plot()`` needs no import of viz; an unregistered type is refused with the way to register one."""
    from arithinterp.drawing import _drawer_module, _lookup, draw

    missing = []
    for cls in RESULT_TYPES:
        if cls.__module__.split(".")[1] in ("sweep", "report") or cls.__name__ == "OperandPlots":
            continue  # above viz; and plots that draw as the FeatureGridsResult of some of their features
        importlib.import_module(_drawer_module(cls, "plot"))
        if _lookup(cls, "plot") is None:
            missing.append(cls.__name__)
    assert missing == []

    class Unknown:
        pass

    with pytest.raises(ConfigError, match=r"no 'plot' drawer is registered for Unknown; register one with "
                                          r"arithinterp.drawing.draws\(Unknown\)"):
        draw(Unknown())


def test_a_result_type_without_a_builder_fails_saying_to_add_one(instances):
    @dataclasses.dataclass(frozen=True)
    class Unbuilt(Result):
        value: int

        def to_frame(self):
            return pd.DataFrame({"value": [self.value]})

        def plot(self, **kwargs):
            return go.Figure()

    with pytest.raises(pytest.fail.Exception, match="Unbuilt is a Result with no example builder: add one to BUILDERS"):
        examples(Unbuilt, instances)


# --- saved folders keep their declared invariants ------------------------------------------------

NOT_DAMAGED = "damaged"  # a string where another kind belongs


def _stored(result: Result, folder) -> tuple[dict, dict]:
    import json

    from safetensors.torch import load_file

    result.save(folder)
    return json.loads((folder / "result.json").read_text()), load_file(str(folder / "tensors.safetensors"))


def _write(folder, stored: dict, tensors: dict) -> None:
    import json

    from safetensors.torch import save_file

    folder.mkdir(parents=True)
    (folder / "result.json").write_text(json.dumps(stored))
    save_file(tensors, str(folder / "tensors.safetensors"))


def _resized(value):
    """``value`` one shorter along its first axis (one longer when empty; an int one larger)."""
    if isinstance(value, torch.Tensor):
        return value[:-1] if len(value) else torch.zeros((1, *value.shape[1:]), dtype=value.dtype)
    if isinstance(value, list):
        return value[:-1] if value else [0]
    return value + 1


def _illegal(value, legal):
    """A value of the same kind as ``value`` that ``legal`` refuses."""
    from arithinterp import results as r

    if isinstance(legal, tuple):
        return [*value[:-1], "not accepted"] if isinstance(value, list) else "not accepted"
    rule = legal[0] if isinstance(legal, list) else legal
    if rule in (r.INCREASING, r.DISTINCT):
        return [*value[:-1], value[0]] if len(value) > 1 else [*value, *value]
    if rule in (r.FLOATING, r.BOOLEAN):
        return value.long()
    if rule is r.SITE:
        return "bogus"
    if rule is r.MEASURED_PROBABILITY:
        return math.nan
    bad = {r.PROBABILITY.description: 2, r.CORRELATION.description: 2, r.NON_NEGATIVE.description: -1,
           r.POSITIVE.description: -1}[rule.description]
    if isinstance(value, torch.Tensor):
        return torch.full_like(value, bad)
    if isinstance(value, list):
        return [bad] * max(len(value), 1)
    return float(bad) if isinstance(value, float) else bad


def _shared_axes(cls, result: Result) -> dict[str, int]:
    """How many present fields name each axis (a fixed length counts as shared with the spec)."""
    counts: dict[str, int] = {}
    for name, spec in cls._shapes.items():
        if getattr(result, name) is not None:
            for axis in spec.split():
                counts[axis] = counts.get(axis, 0) + (2 if axis.isdigit() else 1)
    return counts


def damages(cls, result: Result):
    """``(field, what, value)`` for every damage of a saved ``result``: each field of another kind;
    each declared field resized along its first shared axis; each legal-value field given one it
    may not take."""
    shared = _shared_axes(cls, result)
    for field in dataclasses.fields(cls):
        if not field.compare:  # code, not saved (a heuristic registry)
            continue
        value = getattr(result, field.name)
        yield field.name, "another kind", 12345 if isinstance(value, str) else NOT_DAMAGED
        spec = cls._shapes.get(field.name)
        if spec is not None and value is not None:
            axes = [a for a in spec.split() if a != "..."]
            if shared.get(axes[0], 0) > 1:
                yield field.name, f"resized along {axes[0]!r}", _resized(value)
            elif len(axes) > 1 and isinstance(value, torch.Tensor):
                yield field.name, "an axis dropped", value[0]
        if field.name in cls._legal and value is not None:
            yield field.name, "an illegal value", _illegal(value, cls._legal[field.name])


def _damaged_folder(folder, stored: dict, tensors: dict, field: str, value):
    fields, tensors = dict(stored["fields"]), dict(tensors)
    fields.pop(field, None)
    tensors.pop(field, None)
    if isinstance(value, torch.Tensor):
        tensors[field] = value.contiguous()
    else:
        from arithinterp.results import _plain

        fields[field] = _plain(value)
    _write(folder, {**stored, "fields": fields}, tensors)
    return folder


@pytest.mark.parametrize("cls", RESULT_TYPES, ids=lambda cls: cls.__name__)
def test_every_damaged_field_of_a_saved_folder_is_refused_naming_the_field(cls, instances, tmp_path):
    from arithinterp.errors import ResultFileError

    result = build(cls, instances)
    stored, tensors = _stored(result, tmp_path / "saved")
    missed = []
    for k, (field, what, value) in enumerate(damages(cls, result)):
        folder = _damaged_folder(tmp_path / f"damaged{k}", stored, tensors, field, value)
        try:
            cls.load(folder)
            missed.append(f"{field} ({what}): loaded")
        except ResultFileError as error:
            if repr(field) not in str(error):
                missed.append(f"{field} ({what}): the error does not name the field: {error}")
        except Exception as error:  # noqa: BLE001 - any other exception is what the test is for
            missed.append(f"{field} ({what}): raised {type(error).__name__}: {error}")
    assert not missed, f"{cls.__name__}: " + "; ".join(missed)


@pytest.mark.parametrize("cls", RESULT_TYPES, ids=lambda cls: cls.__name__)
def test_every_type_declares_its_invariants_on_its_own_fields(cls):
    from arithinterp.results import Rule

    names = {f.name for f in dataclasses.fields(cls)}
    assert cls._shapes or cls._legal, f"{cls.__name__} declares no _shapes and no _legal for load to check"
    assert set(cls._shapes) <= names and set(cls._legal) <= names, \
        f"{cls.__name__} declares invariants of fields it lacks: {sorted((set(cls._shapes) | set(cls._legal)) - names)}"
    for name, legal in cls._legal.items():
        rules = legal if isinstance(legal, list) else [legal]
        assert isinstance(legal, tuple) or all(isinstance(rule, Rule) for rule in rules), \
            f"{cls.__name__}._legal[{name!r}] is neither a tuple of values nor rules"


def test_the_issues_damaged_folders_are_refused(instances, tmp_path):
    """A Transcoders folder with ``layers`` reordered (it gave a wrong graph), an AttributionGraph cut short (an
    IndexError later) and a DASLayersResult whose shapes disagree (a row dropped silently)."""
    from arithinterp.errors import ResultFileError

    cases = [(arithinterp.features.Transcoders, "layers", lambda v: v[::-1], "strictly increasing"),
             (arithinterp.features.AttributionGraph, "nodes", lambda v: v[:-3], "share the 'node' axis"),
             (arithinterp.causal.DASLayersResult, "iia", lambda v: v[:1], "share the 'layer' axis")]
    for cls, field, change, message in cases:
        result = build(cls, instances)
        stored, tensors = _stored(result, tmp_path / cls.__name__)
        folder = _damaged_folder(tmp_path / f"{cls.__name__}-damaged", stored, tensors, field,
                                 change(getattr(result, field)))
        with pytest.raises(ResultFileError, match=message):
            cls.load(folder)
