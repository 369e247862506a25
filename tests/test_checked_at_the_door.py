"""Careless input to the newer parts (features, causal, digit circuits, the commands that write) is
refused with an ``ArithInterpError`` before any work, never answered with a silently wrong result:
declared parameter types, prompts analysed exactly as given, every cell of a sweep checked before
the first fit, parts refused on a model they were not made on, shipped data not replaced."""

from __future__ import annotations

import json
import math

from pathlib import Path

import pytest
import torch

from arithinterp.errors import AnalysisError, ArithInterpError, ConfigError, ModelMismatchError, TokenizationError


@pytest.fixture(scope="module")
def parts(tiny_model):
    from arithinterp.features import train_transcoders
    from arithinterp.tasks import arithmetic

    prompts = arithmetic(tiny_model, "+", range(10, 16), range(20, 26))
    transcoders = train_transcoders(tiny_model, prompts, n_features=16, k=2, steps=3, batch_size=64, progress=False)
    return prompts, transcoders


# --- declared parameters ----------------------------------------------------------------------------------


def test_a_negative_batch_size_is_refused_not_turned_into_a_wrong_graph(tiny_model, parts):
    from arithinterp.features import attribution_graph

    prompts, transcoders = parts
    with pytest.raises(ConfigError, match=r"attribution_graph: batch_size=-3 is not accepted .*positive int"):
        attribution_graph(tiny_model, prompts[:1], transcoders, batch_size=-3, progress=False)


@pytest.mark.parametrize("features, match", [
    ("12", r"features='12' is not accepted .*str' instances are not allowed"),  # not features 1 and 2
    ([1.7], r"features=\[1\.7\] \(item \[0\]: 1\.7\) is not accepted"),  # not feature 1
    ([-1], r"features=\[-1\] \(item \[0\]: -1\) is not accepted .*non-negative"),  # not the last feature
    ([3, 3], r"names \[3\] more than once"),
    ([99], r"\[99\] are not features of these transcoders"),
])
def test_feature_lists_are_taken_as_written(tiny_model, parts, features, match):
    from arithinterp.features import intervene, label_features

    prompts, transcoders = parts
    with pytest.raises(ArithInterpError, match=match):
        intervene(tiny_model, prompts[:2], transcoders, 0, features)
    with pytest.raises(ArithInterpError, match=match):
        label_features(tiny_model, prompts, transcoders, 0, features)


def test_a_path_naming_a_feature_twice_is_refused(tiny_model, parts):
    from arithinterp.features import path_ablation

    prompts, transcoders = parts
    with pytest.raises(ConfigError, match=r"names \[2\] more than once"):
        path_ablation(tiny_model, prompts[:4], transcoders, {"p": {0: [2, 2]}}, n_random=1)


def test_seeds_sizes_and_rates_are_never_coerced(tiny_model, parts):
    from arithinterp import cyclic
    from arithinterp.features import train_transcoders

    prompts, _ = parts
    with pytest.raises(ConfigError, match=r"counterfactual: seed=1\.5 is not accepted"):
        cyclic.counterfactual(prompts, seed=1.5)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ConfigError, match=r"lr=nan is not accepted .*finite number > 0"):
        train_transcoders(tiny_model, prompts, lr=math.nan)
    with pytest.raises(AnalysisError, match=r"n_features=300000 .* needs about .* MiB, more than the budget"):
        train_transcoders(tiny_model, prompts, n_features=300000, k=2, steps=1, max_memory="64MiB")
    with pytest.raises(ConfigError, match=r"load_transcoders: path=None is not accepted"):
        __import__("arithinterp").features.load_transcoders(None)


def test_a_byte_size_is_read_wherever_max_memory_is(tiny_model):
    from arithinterp.engine.budget import memory_budget
    from arithinterp.types import byte_size

    assert memory_budget(tiny_model, "1GiB") == 2**30 == byte_size(2.0**30)
    with pytest.raises(ConfigError, match=r"max_memory='lots' is not accepted"):
        memory_budget(tiny_model, "lots")


USER_CODE = """\
from arithinterp.features import train_transcoders
from arithinterp.tasks import PromptSet
from arithinterp.types import HookedModel


def use(model: HookedModel, prompts: PromptSet) -> None:
    train_transcoders(model, prompts, max_memory="1GiB")
    train_transcoders(model, prompts, max_memory=2**30)
    train_transcoders(model, prompts, max_memory=2e9)
    train_transcoders(model, prompts, max_memory=[1])
"""


@pytest.mark.slow
def test_a_size_string_for_max_memory_type_checks_in_a_users_code(tmp_path):
    """``max_memory="1GiB"`` runs, so a type checker must accept it in a user's code as well; a list,
    which does not run, is still reported (and shows that the checker read the package's types)."""
    import shutil
    import subprocess
    import sys

    checker = shutil.which("basedpyright", path=str(Path(sys.executable).parent)) or shutil.which("basedpyright")
    if checker is None:
        pytest.skip("basedpyright is not installed")
    root = Path(__file__).resolve().parent.parent
    (tmp_path / "use.py").write_text(USER_CODE)
    # the package from this checkout (an editable install's import hook is invisible to the checker)
    config = {"include": ["use.py"], "extraPaths": [str(root)], "stubPath": str(root / "typings"),
              "typeCheckingMode": "standard"}
    (tmp_path / "pyrightconfig.json").write_text(json.dumps(config))
    done = subprocess.run([checker, "--outputjson", "--pythonpath", sys.executable, "-p",
                           str(tmp_path / "pyrightconfig.json")], capture_output=True, text=True, timeout=600)
    report = json.loads(done.stdout)
    errors = [(d["range"]["start"]["line"] + 1, d["message"]) for d in report["generalDiagnostics"]
              if d["severity"] == "error"]
    assert [line for line, _ in errors] == [10], errors
    assert "max_memory" in errors[0][1]


# --- prompts exactly as given -----------------------------------------------------------------------------


@pytest.mark.parametrize("prompt, error, match", [
    ("1+" * 30 + "1=", TokenizationError, "more than this model's context"),  # not cut to n_ctx
    ("", TokenizationError, "the prompt is empty"),
    ("hello", TokenizationError, "not in this model's vocabulary"),  # not a graph of <unk> tokens
    (5, ConfigError, r"prompt=5 is not accepted"),  # not token id 5
])
def test_a_prompt_is_analysed_as_given_or_refused(tiny_model, parts, prompt, error, match):
    from arithinterp.features.graph import prompt_graph

    _, transcoders = parts
    with pytest.raises(error, match=match):
        prompt_graph(tiny_model, prompt, transcoders, progress=False)


def test_a_string_is_not_a_prompt_set(tiny_model, parts):
    from arithinterp.features import attribution_graph, graph_sample

    prompts, transcoders = parts
    with pytest.raises(ConfigError, match=r"graph_sample: prompts='12\+21=' is not accepted"):
        graph_sample(tiny_model, "12+21=", transcoders)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ConfigError, match=r"attribution_graph: prompts='12\+21=' is not accepted"):
        attribution_graph(tiny_model, "12+21=", transcoders)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ConfigError, match=r"draws the graph of one prompt, got 2; pass prompts\[i:i \+ 1\]"):
        attribution_graph(tiny_model, prompts[:2], transcoders)


def test_more_answer_logits_than_the_vocabulary_is_refused(tiny_model, parts):
    from arithinterp.features import attribution_graph

    prompts, transcoders = parts
    with pytest.raises(ConfigError, match="more answer tokens than the vocabulary"):
        attribution_graph(tiny_model, prompts[:1], transcoders, n_logits=10**6, progress=False)


def test_a_position_past_the_prompt_is_refused(tiny_model, parts):
    from arithinterp.features import intervene

    prompts, transcoders = parts
    with pytest.raises(ArithInterpError, match=r"positions \[99\] are not all positions"):
        intervene(tiny_model, prompts[:2], transcoders, 0, [1], positions=[99])


# --- a long sample stops and goes on ----------------------------------------------------------------------


def test_a_graph_sample_stops_at_its_budget_and_resumes(tiny_model, parts):
    from arithinterp.features import graph_sample

    prompts, transcoders = parts
    some = prompts[:3]
    with pytest.warns(UserWarning, match="stopped"):
        first = graph_sample(tiny_model, some, transcoders, max_seconds=1e-9, progress=False)
    assert first.meta["n_done"] == 1 and first.meta["stopped"] == "max_seconds" and first.prompts == [some.texts[0]]
    whole = graph_sample(tiny_model, some, transcoders, resume=first, progress=False)
    again = graph_sample(tiny_model, some, transcoders, progress=False)
    assert whole.meta["n_done"] == 3 and whole.features == again.features and whole.scores == again.scores


# --- causal models ----------------------------------------------------------------------------------------


def test_planted_models_need_their_numbers_and_a_finite_scale(digit_tokenizer, number_tokenizer):
    from arithinterp.causal.planted import planted_model

    with pytest.raises(TokenizationError, match=r"needs the numbers 0\.\.19 as single tokens; this tokenizer lacks"):
        planted_model(digit_tokenizer)
    with pytest.raises(ConfigError, match=r"scale=nan is not accepted"):
        planted_model(number_tokenizer, scale=math.nan)


def test_causal_variables_are_whole_numbers_of_non_negative_operands():
    from arithinterp.causal import CausalModel, Variable, addition

    half = CausalModel("halves", (Variable("half", ("a",), lambda a: a / 2),
                                  Variable("answer", ("half",), lambda h: h)))
    with pytest.raises(AnalysisError, match="'half' gave values that are not whole numbers"):
        half.values(torch.tensor([1, 2]), torch.tensor([0, 0]))  # 0.5 is not read as 0
    with pytest.raises(AnalysisError, match="non-negative operands"):
        addition(2).values(torch.tensor([-12]), torch.tensor([3]))  # -12 is not read as 12


def test_a_control_label_that_never_varies_is_refused_before_training(tiny_digit_model, monkeypatch):
    """``value_from="product_parity"`` on operands whose product is always even: the probe baseline
    has nothing to fit, which used to surface only after the whole fit had trained."""
    from arithinterp import causal
    from arithinterp.causal import fit
    from arithinterp.tasks import arithmetic

    prompts = arithmetic(tiny_digit_model, a=range(100, 140, 2), b=range(100, 130))  # a even: a*b mod 2 is always 0
    dataset = causal.interchange_dataset(prompts, "carry_tens", value_from="product_parity", n=60, seed=0)
    trained = []
    monkeypatch.setattr(fit, "train", lambda *args, **kwargs: trained.append(1) or [])
    with pytest.raises(AnalysisError, match="takes one value on the training pairs.*leave 'probe' out of baselines"):
        causal.das(tiny_digit_model, dataset, "resid_post", 0, 2, positions="final", steps=5, progress=False)
    assert trained == []


def test_fits_without_a_score_have_no_best_cell():
    from arithinterp.causal import DASLayersResult

    nan = torch.full((2, 1), math.nan)
    fits = DASLayersResult(variable="v", site="resid_post", layers=[0, 1], positions=["final"], k=2, iia=nan, low=nan,
                           high=nan, random_iia=nan, logit_diff=nan, chance=0.0)
    with pytest.raises(AnalysisError, match="no cell of these fits has a score"):
        fits.best()


# --- parts belong to one model ----------------------------------------------------------------------------


def test_transcoders_refuse_a_model_of_the_same_shape_with_other_weights(number_tokenizer, tiny_model, parts):
    from arithinterp.features import replacement_metrics
    from tests.conftest import tiny_bridge

    prompts, transcoders = parts
    twin = tiny_bridge(number_tokenizer, seed=5)
    with pytest.raises(ModelMismatchError, match="came from another model.*fingerprint"):
        replacement_metrics(twin, prompts[:4], transcoders)
    assert replacement_metrics(tiny_model, prompts[:4], transcoders).agreement >= 0.0
    on_twin = transcoders.on_model(twin)  # declared on purpose
    assert replacement_metrics(twin, prompts[:4], on_twin).agreement >= 0.0


def test_a_fingerprint_survives_a_save_and_follows_the_weights(tiny_model, parts, tmp_path):
    from arithinterp.checks import fingerprint
    from arithinterp.features import load_transcoders

    _, transcoders = parts
    loaded = load_transcoders(transcoders.save(tmp_path / "tc"))
    assert loaded.meta["fingerprint"] == fingerprint(tiny_model) == transcoders.meta["fingerprint"]


def test_an_error_detector_refuses_a_model_of_the_same_shape_with_other_weights(tiny_digit_model, digit_tokenizer):
    from test_probes import _synthetic_evaluation

    from arithinterp import probes
    from arithinterp.tasks import arithmetic
    from tests.conftest import tiny_bridge

    prompts = arithmetic(tiny_digit_model, a=range(100, 120), b=range(100, 110))
    evaluation = _synthetic_evaluation(prompts, digit_tokenizer, torch.arange(len(prompts)) % 5 == 0)
    detector = probes.ErrorDetector(layers=1, method="direct", cv=2).fit(tiny_digit_model, prompts, evaluation)
    twin = tiny_bridge(digit_tokenizer, seed=5)  # the same shape and vocabulary, other weights
    with pytest.raises(ModelMismatchError, match="the detector came from another model.*fingerprint"):
        detector.predict_proba(twin, prompts, evaluation)
    assert detector.predict_proba(tiny_digit_model, prompts, evaluation).shape == (len(prompts),)


def test_a_das_subspace_read_back_from_pyvene_files_refuses_another_model(number_tokenizer, tiny_model, tmp_path):
    from arithinterp import causal
    from arithinterp.checks import fingerprint
    from arithinterp.tasks import arithmetic
    from tests.conftest import tiny_bridge

    dataset = causal.interchange_dataset(arithmetic(tiny_model, "+", range(10, 22), range(20, 32)), "sum_mod_10",
                                         n=60, seed=0)
    fit = causal.das(tiny_model, dataset, "resid_post", 0, 2, positions="final", steps=3, baselines=(), progress=False)
    subspace, where = causal.read_pyvene(causal.write_pyvene(fit, tmp_path / "pyvene"))
    assert subspace.meta["fingerprint"] == fingerprint(tiny_model)
    twin = tiny_bridge(number_tokenizer, seed=5)
    with pytest.raises(ModelMismatchError, match="score_subspace: the subspace came from another model.*fingerprint"):
        causal.score_subspace(twin, dataset, subspace, where)
    assert causal.score_subspace(tiny_model, dataset, subspace, where)["iia"] == fit.iia


def test_the_shipped_transcoders_carry_their_models_fingerprint():
    from arithinterp.features.shipped import WEIGHTS_DIR

    for name in ("add-100", "add-3digit"):
        meta = json.loads((WEIGHTS_DIR / name / "result.json").read_text())["fields"]["meta"]
        assert len(meta["fingerprint"]) == 16


# --- writing commands -------------------------------------------------------------------------------------


def test_planned_transcoders_refuse_an_occupied_folder_before_any_work(tmp_path, monkeypatch, tiny_model):
    from arithinterp.features import plan, training
    from arithinterp.features.cache import cache_folder

    monkeypatch.setenv("ARITHINTERP_CACHE", str(tmp_path / "cache"))
    started = []
    monkeypatch.setattr(training, "train_transcoders", lambda *args, **kwargs: started.append(1))
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("mine")
    settings = plan.plan_transcoders(tiny_model, operands="10-29", few_shot=0)
    with pytest.raises(ConfigError, match="already holds files"):
        plan.train_planned(tiny_model, settings, occupied, progress=False)
    assert not started and [p.name for p in occupied.iterdir()] == ["notes.txt"]
    assert cache_folder(tiny_model).is_relative_to(tmp_path / "cache")  # the default out: the user's cache


def test_interrupted_transcoder_training_leaves_no_out_folder(tmp_path, monkeypatch, capsys):
    """Ctrl-C left an empty --out folder that the next run refused without --overwrite."""
    from arithinterp.cli import main
    from arithinterp.features import training

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(training, "train_transcoders", interrupt)
    out = tmp_path / "transcoders"
    assert main(["train-transcoders", "zoo:add-100", "--steps", "1", "--out", str(out), "--no-progress"]) == 130
    assert "interrupted" in capsys.readouterr().err
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_commands_check_their_outputs_and_numbers_before_work(tmp_path, capsys):
    from arithinterp.cli import main

    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("mine")
    assert main(["train-transcoders", "zoo:add-100", "--out", str(occupied), "--steps", "1", "--json"]) == 2
    assert "already holds files" in json.loads(capsys.readouterr().out)["error"]
    assert main(["das", "zoo:add-100", "--variable", "sum", "--every-layer", "--layers", "0,x", "--json"]) == 2
    assert "--layers takes comma-separated whole numbers" in json.loads(capsys.readouterr().out)["error"]


@pytest.mark.parametrize("change, match", [
    (dict(resources=dict(num_cpus=math.nan)), r"resources\.num_cpus: must be a finite number >= 0, got nan"),
    (dict(resources=dict(num_gpus=math.inf)), r"resources\.num_gpus: must be a finite number >= 0, got inf"),
    (dict(task=dict(seed=-1)), r"tasks\[0\]\.seed: must be an int in 0\.\.4294967295, got -1"),
    (dict(task=dict(seed=2**63 - 1)), r"tasks\[0\]\.seed: must be an int in 0\.\.4294967295"),
    (dict(params=dict(seed=2**40)), r"analyses\[0\]\.params\.seed: must be an int in 0\.\.4294967295"),
    (dict(params=dict(layers=[])), r"analyses\[0\]\.params\.layers: an empty list"),  # not 'all layers'
    (dict(params=dict(positions=["a", "a"])), r"analyses\[0\]\.params\.positions: 'a' named more than once"),
    (dict(grid=dict(layers=[[0, 0]])), r"analyses\[0\]\.grid\.layers\[0\]: 0 named more than once"),
])
def test_a_sweep_config_refuses_what_would_fail_its_cells(change, match):
    from arithinterp.sweep.config import load_config

    analysis = dict(name="probes", params=dict(target="a", **change.get("params", {})))
    if "grid" in change:
        analysis["grid"] = change["grid"]
    config = dict(models=["zoo:add-100"], tasks=[dict(name="t", a=[0, 10], b=[0, 10], **change.get("task", {}))],
                  analyses=[analysis], resources=change.get("resources", {}))
    with pytest.raises(ConfigError, match=match):
        load_config(config)


def test_a_template_that_repeats_an_operand_and_a_few_shot_no_context_holds_are_refused(monkeypatch):
    """'{a}+{b}+{a}=' would be scored against a+b; 100,000 examples took 90 s to build before the
    prompts were refused for their length."""
    import arithinterp as ai
    import arithinterp.tasks.templates as templates
    from arithinterp.errors import TaskError
    from arithinterp.tasks import arithmetic

    model = ai.load_model("zoo:add-100")
    with pytest.raises(TaskError, match=r"must contain '\{a\}' and '\{b\}' once each, got '\{a\}\+\{b\}\+\{a\}='"):
        arithmetic(model, "+", range(3), range(3), template="{a}+{b}+{a}=")
    rendered = []
    real = templates.render
    monkeypatch.setattr(templates, "render", lambda *a, **k: rendered.append(a) or real(*a, **k))
    with pytest.raises(TaskError, match=r"few_shot must be at most 1000 examples, got 100,000"):
        arithmetic(model, "+", range(3), range(3), few_shot=100_000)
    assert not rendered  # refused before a single example is written, not after building them all


@pytest.mark.parametrize("period", [1.0, 0.5, 1e300])
def test_a_period_that_is_constant_on_whole_numbers_is_refused(period):
    """Period 1 and 1e300 gave the same fit (their cos and sin columns are constant on whole numbers)."""
    from arithinterp import helix

    with pytest.raises(ConfigError, match="periods must be numbers from 2 to 1e\\+06"):
        helix.basis(torch.arange(10.0), periods=[10, period])


@pytest.mark.parametrize("analysis", ["circuits.score_edges", "circuits.attribute_edges", "circuits.digit_circuits",
                                      "patching.attribute"])
def test_integration_steps_past_the_maximum_are_refused_before_work(tiny_model, analysis):
    """ig_steps=10**9 ran a forward and backward pass per step for hours without a word."""
    import importlib

    module, name = analysis.split(".")
    fn = getattr(importlib.import_module(f"arithinterp.{module}"), name)
    with pytest.raises(ConfigError, match=r"ig_steps=1000000000 is not accepted.*an int from 1 to 1000"):
        fn(tiny_model, None, ig_steps=10**9)


@pytest.mark.parametrize("call, match", [
    (lambda m, parts: __import__("arithinterp.features", fromlist=["x"]).train_transcoders(
        m, parts[0], n_features=8, k=2, steps=2, lr=1e300, progress=False), r"lr=1e\+300 is not accepted"),
    (lambda m, parts: __import__("arithinterp.features", fromlist=["x"]).intervene(
        m, parts[0], parts[1], 0, [0], clamp=1e300), r"clamp=1e\+300 is not accepted"),
])
def test_a_number_float32_cannot_hold_is_refused_not_overflowed(tiny_model, parts, call, match):
    """lr or clamp = 1e300 is finite, but overflows the float32 optimizer or activations: a raw RuntimeError."""
    with pytest.raises(ConfigError, match=match + r".*what float32 holds"):
        call(tiny_model, parts)


@pytest.mark.parametrize("call, match", [
    (lambda: __import__("arithinterp.patching", fromlist=["x"]).summarize(torch.rand(5), confidence=2),
     "confidence=2 is not accepted"),
    (lambda: __import__("arithinterp.patching", fromlist=["x"]).summarize(torch.rand(5), n_boot=0),
     "n_boot=0 is not accepted"),
    (lambda: __import__("arithinterp.patching", fromlist=["x"]).summarize(torch.zeros(0)), "at least one pair"),
    (lambda: __import__("arithinterp.causal", fromlist=["x"]).wilson(5, 3), "correct=5 exceeds n=3"),
    (lambda: __import__("arithinterp.causal", fromlist=["x"]).wilson(-1, 3), "correct=-1 is not accepted"),
    (lambda: __import__("arithinterp.causal", fromlist=["x"]).full_vector(-1), "d=-1 is not accepted"),
    (lambda: __import__("arithinterp.causal", fromlist=["x"]).orthonormal(torch.full((4, 2), math.nan)),
     "NaN or infinite"),
    (lambda: __import__("arithinterp.probes", fromlist=["x"]).confidence_interval(torch.rand(5), level=2),
     "level=2 is not accepted"),
    (lambda: __import__("arithinterp.features", fromlist=["x"]).topk_activations(torch.rand(3, 5), 99),
     r"k=99 must lie in 1..5"),
    (lambda: __import__("arithinterp.features", fromlist=["x"]).topk_activations(torch.rand(3, 5), -1),
     "k=-1 is not accepted"),
])
def test_small_helpers_refuse_what_gave_a_raw_error_or_nan(call, match):
    """Each was a raw RuntimeError / ValueError (or, for a level of 2, a NaN interval without a word)."""
    with pytest.raises(ArithInterpError, match=match):
        call()


def test_das_layers_and_probe_layers_refuse_a_row_named_twice(tiny_model):
    """layers=[0, 0] (or a position twice) fitted the same cell twice and reported it as two rows."""
    from arithinterp import collect
    from arithinterp.causal import das_layers, interchange_dataset
    from arithinterp.errors import SiteError
    from arithinterp.probes import probe_layers
    from arithinterp.tasks import arithmetic

    prompts = arithmetic(tiny_model, "+", range(10, 22), range(20, 32))
    pairs = interchange_dataset(prompts, "sum_mod_10", n=40, seed=0)
    with pytest.raises(ConfigError, match="layers=.* names one more than once"):
        das_layers(tiny_model, pairs, layers=[0, 0], steps=1, progress=False)
    with pytest.raises(ConfigError, match="positions=.* names one more than once"):
        das_layers(tiny_model, pairs, positions=["final", "final"], steps=1, progress=False)
    acts = collect(tiny_model, prompts[:40], "resid_post")
    with pytest.raises(SiteError, match="names one of the layers more than once"):
        probe_layers(acts, prompts[:40].label("a"), layers=[0, 0], progress=False)


@pytest.mark.parametrize("call, match", [
    (lambda m, p: __import__("arithinterp.fourier", fromlist=["x"]).embedding_spectrum(m, 10, n_shuffles=-1),
     r"embedding_spectrum: n_shuffles=-1 is not accepted .*n_shuffles accepts a non-negative int"),
    (lambda m, p: __import__("arithinterp.helix", fromlist=["x"]).fit(torch.rand(8, 4), list(range(8)), n_shuffles=1.5),
     r"fit: n_shuffles=1\.5 is not accepted .*non-negative int"),
    (lambda m, p: __import__("arithinterp.helix", fromlist=["x"]).search_periods(torch.rand(8, 4), list(range(8)),
                                                                               n_shuffles=-2),
     r"search_periods: n_shuffles=-2 is not accepted .*non-negative int"),
    (lambda m, p: p.evaluate(m, batch_size=0), r"PromptSet\.evaluate: batch_size=0 is not accepted .*positive int"),
    (lambda m, p: p.answer_logprob(m, batch_size=True),
     r"PromptSet\.answer_logprob: batch_size=True is not accepted .*positive int"),
    (lambda m, p: __import__("arithinterp.tasks", fromlist=["x"]).arithmetic(m, "+", [1], [2], modulus=1),
     r"prompts_for_pairs: modulus=1 is not accepted .*an int >= 2"),
    (lambda m, p: __import__("arithinterp.tasks", fromlist=["x"]).arithmetic(m, "+", [1], [2], answer_digits=-1),
     r"prompts_for_pairs: answer_digits=-1 is not accepted .*non-negative int"),
    (lambda m, p: __import__("arithinterp.patching", fromlist=["x"]).vary_digit(p, 1),
     r"vary_digit: place=1 is not accepted .*str"),
    (lambda m, p: __import__("arithinterp.patching", fromlist=["x"]).vary_digit(p, "tenths"),
     r"unknown place 'tenths'; accepted: units, tens, hundreds"),
    (lambda m, p: __import__("arithinterp.patching", fromlist=["x"]).digit_pairs(p.counterfactual(vary="a"), -1),
     r"digit_pairs: answer_token=-1 is not accepted .*non-negative int"),
    (lambda m, p: __import__("arithinterp.patching", fromlist=["x"]).attribute(m, p.counterfactual(vary="a"),
                                                                             batch_size=0),
     r"attribute: batch_size=0 is not accepted .*positive int .* or None"),
    (lambda m, p: __import__("arithinterp.patching", fromlist=["x"]).activation_patching(
        m, p.counterfactual(vary="a"), "resid_pre", batch_cells=-1),
     r"activation_patching: batch_cells=-1 is not accepted .*positive int"),
    (lambda m, p: __import__("arithinterp.circuits", fromlist=["x"]).score_edges(m, p.counterfactual(vary="a"), "eap",
                                                                               batch_size=0),
     r"score_edges: batch_size=0 is not accepted .*positive int"),
    (lambda m, p: __import__("arithinterp.circuits", fromlist=["x"]).patch_edges(m, p.counterfactual(vary="a"),
                                                                               batch_cells=0),
     r"patch_edges: batch_cells=0 is not accepted .*positive int"),
    (lambda m, p: __import__("arithinterp.circuits", fromlist=["x"]).curve_sizes(-1),
     r"curve_sizes: n_edges=-1 is not accepted .*non-negative int"),
    (lambda m, p: __import__("arithinterp.neurons", fromlist=["x"]).importance(m, p.counterfactual(vary="a"), top_k=0),
     r"importance: top_k=0 is not accepted .*positive int"),
    (lambda m, p: __import__("arithinterp.neurons", fromlist=["x"]).importance(m, p.counterfactual(vary="a"),
                                                                             top_k=m.cfg.d_mlp + 1, progress=False),
     r"top_k must be an integer in 1\.\.\d+ \(d_mlp\) or None"),
    (lambda m, p: __import__("arithinterp.neurons", fromlist=["x"]).maps(m, p, neurons={0: [0]}, batch_size=-1),
     r"maps: batch_size=-1 is not accepted .*positive int"),
    (lambda m, p: __import__("arithinterp.neurons", fromlist=["x"]).classify(m, p, min_cells=0),
     r"classify: min_cells=0 is not accepted .*positive int"),
    (lambda m, p: __import__("arithinterp.neurons", fromlist=["x"]).build_heuristics(range(5), range(5), "+",
                                                                                    min_cells=0),
     r"build_heuristics: min_cells=0 is not accepted .*positive int"),
    (lambda m, p: __import__("arithinterp.neurons", fromlist=["x"]).classify_maps(
        torch.rand(2, 5, 5), None, range(5), range(5), "+", chunk_size=0),
     r"classify_maps: chunk_size=0 is not accepted .*positive int"),
    (lambda m, p: __import__("arithinterp.neurons", fromlist=["x"]).apply_op(torch.arange(3), torch.arange(3), "+",
                                                                            modulus=0),
     r"apply_op: modulus=0 is not accepted .*an int >= 2"),
])
def test_counts_and_sizes_are_declared_not_checked_by_hand(tiny_model, call, match):
    """Batch sizes, shuffle counts, moduli, digit columns and the like are refused at the door with the
    declared-type message (ConfigError naming the function); what needs the model or the data (``top_k``
    at most ``d_mlp``) is still checked in the body."""
    from arithinterp.tasks import arithmetic

    prompts = arithmetic(tiny_model, "+", range(10, 16), range(20, 26))
    with pytest.raises(ConfigError, match=match):
        call(tiny_model, prompts)


def test_neuron_map_scoring_refuses_an_empty_chunk():
    """chunk_size=0 reached range(0, N, 0): a raw ValueError."""
    from arithinterp.neurons.map_scores import score_maps

    with pytest.raises(ConfigError, match=r"chunk_size=0 is not accepted"):
        score_maps(torch.rand(3, 4, 4), torch.rand(2, 4, 4) > 0.5, chunk_size=0)
