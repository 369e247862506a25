"""Inputs that used to give a wrong answer without a word, or a raw traceback: each is now refused
with an ``ArithInterpError`` that names the problem."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from arithinterp.errors import ArithInterpError, ConfigError, SiteError, TaskError, TokenizationError
from arithinterp.tasks import arithmetic


# --- prompts that contradict their labels ----------------------------------------------------------


def test_default_template_writes_the_operator(tiny_model):
    prompts = arithmetic(tiny_model, "-", a=[50], b=[7])
    assert prompts.texts == ("50-7=",) and prompts.answer.tolist() == [43]
    assert arithmetic(tiny_model, "mod", a=[9], b=[4]).texts == ("9%4=",)


def test_template_showing_another_operator_is_refused(tiny_model):
    with pytest.raises(TaskError, match=r"template '\{a\}\+\{b\}=' writes the operator '\+' but op is '-'"):
        arithmetic(tiny_model, "-", a=[50], b=[7], template="{a}+{b}=")


def test_operator_counterfactual_changes_the_text(tiny_model):
    prompts = arithmetic(tiny_model, "+", range(1, 20), range(1, 20), "{a}{op}{b}=")[::5]
    pairs = prompts.counterfactual(vary="operator", seed=0)
    assert all(c != k for c, k in zip(pairs.clean.texts, pairs.corrupt.texts))
    assert not torch.equal(pairs.clean.tokens, pairs.corrupt.tokens)
    for text, answer in zip(pairs.corrupt.texts, pairs.corrupt.answer.tolist()):
        assert eval(text.rstrip("=")) == answer  # the corrupt text computes its own label


def test_operator_counterfactual_without_op_field_is_refused(tiny_model):
    prompts = arithmetic(tiny_model, "+", range(1, 10), range(1, 10), "{a}+{b}=")
    with pytest.raises(TaskError, match=r"vary='operator' needs the operator in the prompt text"):
        prompts.counterfactual(vary="operator")


# --- indexing and operand values -----------------------------------------------------------------


def test_prompt_index_out_of_range_is_refused(tiny_model):
    prompts = arithmetic(tiny_model, "+", range(20), range(20))
    assert prompts[399].texts == prompts.texts[399:] and prompts[-400].texts == prompts.texts[:1]
    with pytest.raises(IndexError, match=r"index 400 is out of range for 400 prompts; accepted: -400\.\.399"):
        prompts[400]
    with pytest.raises(TaskError, match="index -401 is out of range"):
        prompts[-401]
    assert len(list(prompts[:3])) == 3  # iteration stops at the end instead of wrapping forever


@pytest.mark.parametrize("a, match", [
    ("123", "got the string '123'"),
    ([1.5, 2.7], r"a must hold integers, got 1\.5 \(float\)"),
    ([True], "a must hold integers"),
    ([10**20], "does not fit in 64 bits"),
])
def test_operands_are_never_converted(tiny_model, a, match):
    with pytest.raises(TaskError, match=match):
        arithmetic(tiny_model, "+", a=a, b=[1])


def test_numpy_and_torch_integers_are_accepted(tiny_model):
    import numpy as np

    assert arithmetic(tiny_model, "+", a=np.arange(3), b=torch.arange(2)).a.tolist() == [0, 0, 1, 1, 2, 2]


def test_huge_operands_with_a_digit_tokenizer(tiny_digit_model):
    with pytest.raises(TaskError, match="does not fit in 64 bits"):
        arithmetic(tiny_digit_model, "+", a=[10**20], b=[1])
    with pytest.raises(TaskError, match=r"the answer of 4611686018427387904 \* 4 does not fit in 64 bits"):
        arithmetic(tiny_digit_model, "*", a=[2**62], b=[4])


# --- templates, few-shot, counterfactual operators -----------------------------------------------


def test_unknown_template_field_is_refused_with_few_shot(tiny_model):
    with pytest.raises(TaskError, match=r"unknown field \{c\}; accepted fields: \{a\}, \{b\}, \{op\}"):
        arithmetic(tiny_model, "+", a=range(3), b=range(3), template="{a}+{b}={c}", few_shot=2)


def test_counterfactual_unknown_operator_is_refused(tiny_model):
    prompts = arithmetic(tiny_model, "+", range(1, 10), range(1, 10))
    with pytest.raises(ConfigError, match=r"unknown operator '\^' in ops; accepted: '\+', '-'"):
        prompts.counterfactual(vary="operator", ops=("^",))


def test_few_shot_longer_than_the_context_is_refused_when_built(number_tokenizer):
    from tests.conftest import tiny_bridge

    model = tiny_bridge(number_tokenizer, n_ctx=16)
    with pytest.raises(TaskError, match=r"more than the model's context of 16 tokens \(the longest prompt is \d+ tokens, with a few-shot prefix of 5 "):
        arithmetic(model, "+", a=range(3), b=range(3), few_shot=5)
    assert len(arithmetic(model, "+", a=range(3), b=range(3), few_shot=1)) == 9


# --- layers, positions, storage, devices ----------------------------------------------------------


def _prompts(model):
    return arithmetic(model, "+", range(10), range(10))


def test_fractional_layer_is_refused(tiny_model):
    from arithinterp.activations import collect

    with pytest.raises(ArithInterpError, match=r"layers=\[0\.7\] \(item \[0\]: 0\.7\) is not accepted"):
        collect(tiny_model, _prompts(tiny_model), layers=[0.7], progress=False)
    with pytest.raises(ArithInterpError, match="layers='1' is not accepted .*str' instances are not allowed"):
        collect(tiny_model, _prompts(tiny_model), layers="1", progress=False)


def test_ablation_position_past_the_prompt_is_refused(tiny_model):
    from arithinterp import patching

    prompts = _prompts(tiny_model)  # 5 tokens: BOS a + b =
    with pytest.raises(SiteError, match=r"component 'attn0@99': position 99 is out of range for prompts of 5 tokens; "
                                        r"accepted: 0\.\.4"):
        patching.ablate(tiny_model, prompts, ["attn0@99"])
    assert patching.ablate(tiny_model, prompts, ["attn0@4"]).components == ["attn0@4"]


def test_empty_positions_are_refused(tiny_model):
    from arithinterp.activations import collect

    with pytest.raises(SiteError, match="positions is empty; accepted: 'final'"):
        collect(tiny_model, _prompts(tiny_model), positions=[], progress=False)


def test_bfloat16_on_disk_is_refused_before_any_forward(tiny_model, tmp_path):
    from arithinterp.activations import collect

    with pytest.raises(ArithInterpError, match=r"dtype torch\.bfloat16 cannot be stored on disk"):
        collect(tiny_model, _prompts(tiny_model), dtype=torch.bfloat16, store=tmp_path / "acts", progress=False)
    assert not (tmp_path / "acts").exists()
    kept = collect(tiny_model, _prompts(tiny_model), dtype=torch.bfloat16, progress=False)  # in memory it works
    assert kept["resid_post"].dtype == torch.bfloat16


def test_unwritable_store_is_refused(tiny_model):
    from arithinterp.activations import collect

    with pytest.raises(ArithInterpError, match=r"store: cannot write to /proc/x \(.+\); give a path in a writable"):
        collect(tiny_model, _prompts(tiny_model), store="/proc/x", progress=False)


def test_cuda_without_a_gpu_is_refused(monkeypatch):
    import arithinterp as ai
    from arithinterp.errors import ModelSpecError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ModelSpecError, match=r"device 'cuda' needs a CUDA GPU, but torch sees none here"):
        ai.load_model("zoo:add-100", device="cuda")
    with pytest.raises(ModelSpecError, match="unknown device 'gpu0'"):
        ai.load_model("zoo:add-100", device="gpu0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ModelSpecError, match=r"device 'cuda:3': torch sees 1 CUDA GPU\(s\); accepted: cuda:0"):
        ai.load_model("zoo:add-100", device="cuda:3")


def test_helix_fit_on_non_finite_activations_is_refused():
    from arithinterp import helix
    from arithinterp.errors import AnalysisError

    values = torch.arange(60).double()
    acts = torch.randn(60, 16)
    acts[3, 0] = float("nan")
    acts[7, 2] = float("inf")
    with pytest.raises(AnalysisError, match="2 of 60 activation rows hold NaN or infinite values"):
        helix.fit(acts, values, periods=(10,))


def test_zero_prompt_limit_is_refused(tiny_model):
    from arithinterp.models.zoo import task_prompts

    with pytest.raises(TaskError, match="limit must be a positive number of prompts"):
        task_prompts(tiny_model, "zoo:add-100", limit=0)


# --- damaged checkpoints --------------------------------------------------------------------------


@pytest.fixture()
def add100_copy(tmp_path):
    import shutil

    from arithinterp.models.zoo import get_entry

    directory = tmp_path / "add-100"
    shutil.copytree(get_entry("add-100").directory, directory, ignore=shutil.ignore_patterns("snapshots"))
    return directory


def _weights(directory):
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


def _save(directory, state):
    from safetensors.torch import save_file

    save_file(state, str(directory / "model.safetensors"))


def test_intact_copy_loads(add100_copy):
    import arithinterp as ai

    model = ai.load_model(str(add100_copy))
    assert torch.isfinite(model.W_E).all()


@pytest.mark.parametrize("damage, match", [
    ("drop_layer", r"model\.safetensors lacks 16 of the model's 37 weight tensors \(layers\.1\.ln1\.weight, "
                   r"layers\.1\.ln1\.bias, .*partly random model"),
    ("empty_dict", r"model\.safetensors lacks 37 of the model's 37 weight tensors"),
    ("wrong_shape", r"model\.safetensors does not fit .*config\.json: size mismatch for layers\.0\.ln1\.weight"),
    ("truncated", r"model\.safetensors is damaged, truncated or not a safetensors file"),
    ("zero_bytes", r"model\.safetensors is damaged, truncated or not a safetensors file"),
    ("bad_json", r"config\.json cannot be read as JSON"),
    ("bad_config", r"config\.json does not describe a model TransformerLens can build"),
    ("no_tokenizer", r"tokenizer\.json is missing; a native model directory needs tokenizer\.json"),
])
def test_damaged_checkpoint_is_refused_naming_the_file(add100_copy, damage, match):
    import arithinterp as ai
    from arithinterp.errors import ModelFileError

    weights = add100_copy / "model.safetensors"
    if damage == "drop_layer":
        _save(add100_copy, {k: v for k, v in _weights(add100_copy).items() if not k.startswith("layers.1.")})
    elif damage == "empty_dict":
        _save(add100_copy, {})
    elif damage == "wrong_shape":
        _save(add100_copy, dict(_weights(add100_copy), **{"layers.0.ln1.weight": torch.ones(3)}))
    elif damage == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    elif damage == "zero_bytes":
        weights.write_bytes(b"")
    elif damage == "bad_json":
        (add100_copy / "config.json").write_text("{\"n_layers\": 2,")
    elif damage == "bad_config":
        (add100_copy / "config.json").write_text("{\"n_layers\": \"two\", \"d_model\": -1}")
    elif damage == "no_tokenizer":
        (add100_copy / "tokenizer.json").unlink()
    with pytest.raises(ModelFileError, match=match):
        ai.load_model(str(add100_copy))


def test_helix_fit_on_a_nan_model_is_refused(number_tokenizer):
    from arithinterp import helix
    from arithinterp.activations import collect
    from arithinterp.errors import AnalysisError
    from tests.conftest import tiny_bridge

    model = tiny_bridge(number_tokenizer, seed=3)
    with torch.no_grad():
        model.W_E[5] = float("nan")  # the embedding of one number token
    prompts = arithmetic(model, "+", range(20), range(5))
    acts = collect(model, prompts, sites="resid_pre", layers=[1], positions="a", progress=False)
    with pytest.raises(AnalysisError, match=r"activation rows hold NaN or infinite values; a helix needs finite"):
        helix.fit(acts, "a", periods=(2, 5, 10))


# --- answers the tokenizer cannot spell -------------------------------------------------------------


def test_answer_outside_the_vocabulary_is_refused(tiny_model):
    # the number tokenizer spells 0..198 only: 99 * 99 = 9801 would become <unk>
    with pytest.raises(TokenizationError, match=r"the answer '9801' of prompt '99\*99=' contains text the "
                                                r"tokenizer does not know \(it maps to '<unk>'\)"):
        arithmetic(tiny_model, "*", a=[99, 3], b=[99, 4], template="{a}*{b}=", scoring="full-answer")
    assert arithmetic(tiny_model, "*", a=[3], b=[4], template="{a}*{b}=").answer_tokens.tolist() != [[0]]


def test_operator_counterfactuals_never_pair_with_an_unspellable_answer(tiny_model):
    unk = tiny_model.tokenizer.unk_token_id
    prompts = arithmetic(tiny_model, "+", range(5, 40), range(5, 40), "{a}{op}{b}=")[::7]
    pairs = prompts.counterfactual(vary="operator", seed=0)
    assert len(pairs) > 20 and not (pairs.corrupt.answer_tokens == unk).any()
    assert all(eval(t.rstrip("=")) <= 198 for t in pairs.corrupt.texts)


# --- the model argument and what belongs to it ------------------------------------------------------


def _pairs(model, n=6):
    return arithmetic(model, "+", range(10, 16), range(20, 26)).counterfactual(vary="a", seed=0)[:n]


def _entries():
    """Public entries, each called with (model, pairs-or-prompts) as a user would."""
    import arithinterp as ai

    return {
        "patching.activation_patching": lambda m, p: ai.patching.activation_patching(m, p, "resid_pre", progress=False),
        "patching.attribute": lambda m, p: ai.patching.attribute(m, p, "resid_pre"),
        "circuits.score_edges": lambda m, p: ai.circuits.score_edges(m, p, "eap", progress=False),
        "neurons.importance": lambda m, p: ai.neurons.importance(m, p, layers=[0]),
        "neurons.classify": lambda m, p: ai.neurons.classify(m, p.clean, layers=[0], top_k=4),
        "collect": lambda m, p: ai.collect(m, p.clean, progress=False),
        "PromptSet.evaluate": lambda m, p: p.clean.evaluate(m),
        "ErrorDetector.fit": lambda m, p: ai.probes.ErrorDetector(cv=2).fit(m, p.clean),
    }


@pytest.mark.parametrize("entry", list(_entries()))
@pytest.mark.parametrize("model", ["zoo:add-100", object()], ids=["string", "object"])
def test_something_that_is_not_a_model_is_refused_at_the_entry(tiny_model, entry, model):
    from arithinterp.errors import ModelSpecError

    match = ("model must be a loaded model, got the str 'zoo:add-100'; load it first" if isinstance(model, str)
             else "model must be a hooked model .* got object, which lacks cfg, to_tokens, run_with_cache")
    with pytest.raises(ModelSpecError, match=f"{entry}: {match}"):
        _entries()[entry](model, _pairs(tiny_model))


@pytest.mark.parametrize("entry", list(_entries()))
def test_pairs_built_for_another_tokenizer_are_refused(tiny_model, tiny_digit_model, entry):
    from arithinterp.errors import ModelMismatchError

    with pytest.raises(ModelMismatchError, match=rf"{entry}: the (pairs|prompts) were built with another tokenizer "
                                                 r"\(a vocabulary of \d+ tokens; this model's has 209\); build them"):
        _entries()[entry](tiny_model, _pairs(tiny_digit_model))
    try:
        _entries()[entry](tiny_model, _pairs(tiny_model))  # the model's own pairs are not refused as foreign
    except ModelMismatchError:
        raise
    except ArithInterpError:
        pass  # e.g. six prompts are too few to fit a detector: another problem, reported as such


def test_prompts_longer_than_the_context_or_past_the_vocabulary_are_refused(number_tokenizer, tiny_model):
    from arithinterp import patching
    from arithinterp.errors import ModelMismatchError
    from tests.conftest import tiny_bridge

    pairs = _pairs(tiny_model)  # 5 tokens, ids up to ~200
    short = tiny_bridge(number_tokenizer, n_ctx=4)
    with pytest.raises(ModelMismatchError, match=r"patching.activation_patching: the pairs do not fit this model: "
                                                 r"the pairs' tokens are 5 tokens long, more than this model's "
                                                 r"context of 4 tokens"):
        patching.activation_patching(short, pairs, "resid_pre", progress=False)
    small_vocab = tiny_bridge(number_tokenizer, d_vocab=20)
    with pytest.raises(ModelMismatchError, match=r"the pairs' tokens hold the token id \d+, outside this model's "
                                                 r"vocabulary of 20 tokens \(accepted: 0\.\.19\)"):
        patching.activation_patching(small_vocab, pairs, "resid_pre", progress=False)


@pytest.fixture(scope="module")
def three_layers(number_tokenizer):
    from tests.conftest import tiny_bridge

    return tiny_bridge(number_tokenizer, n_layers=3)


def test_circuit_from_another_model_is_refused(tiny_model, three_layers):
    from arithinterp import circuits
    from arithinterp.errors import ModelMismatchError

    circuit = circuits.score_edges(tiny_model, _pairs(tiny_model), "eap", progress=False)
    pairs = _pairs(three_layers)
    for call in (lambda: circuits.faithfulness_curve(three_layers, pairs, circuit, sizes=[3]),
                 lambda: circuits.edge_faithfulness(three_layers, pairs, circuits.top_n(circuit, 3)),
                 lambda: circuits.minimality(three_layers, pairs, circuits.top_n(circuit, 3)),
                 lambda: circuits.prune(three_layers, pairs, circuit)):
        with pytest.raises(ModelMismatchError, match=r"circuits\.\w+: the circuit was made on another model .*"
                                                     r"n_layers 2 vs 3 \(its value vs this model's\)"):
            call()
    # the model it was made on takes it (6 pairs may be too few for a fraction, so the curve, which says so)
    assert len(circuits.faithfulness_curve(tiny_model, _pairs(tiny_model), circuit, sizes=[3]).faithfulness) == 1


def test_a_model_of_the_same_shape_takes_the_circuit_only_when_declared(tiny_model, number_tokenizer):
    from arithinterp import circuits
    from tests.conftest import tiny_bridge

    from arithinterp.errors import ModelMismatchError

    twin = tiny_bridge(number_tokenizer, seed=5)  # other weights, same graph and vocabulary
    circuit = circuits.score_edges(tiny_model, _pairs(tiny_model), "eap", progress=False)
    with pytest.raises(ModelMismatchError, match="fingerprint"):  # the weights differ: not the model it was made on
        circuits.faithfulness_curve(twin, _pairs(twin), circuit, sizes=[3])
    # a control on purpose: the circuit declared for the twin
    assert len(circuits.faithfulness_curve(twin, _pairs(twin), circuit.on_model(twin), sizes=[3]).faithfulness) == 1


@pytest.mark.slow
def test_detector_fitted_on_another_model_is_refused():
    import arithinterp as ai
    from arithinterp import probes
    from arithinterp.errors import ModelMismatchError
    from tests.conftest import tiny_bridge

    from arithinterp.models.zoo import task_prompts

    model = ai.load_model("zoo:add-3digit-weak")  # about 90% correct: errors to detect
    narrow = tiny_bridge(model.tokenizer, d_model=32)  # the same vocabulary, another shape
    prompts = task_prompts(model, "zoo:add-3digit-weak", 300, 0)
    detector = probes.ErrorDetector(cv=2, layers=[1]).fit(model, prompts)
    with pytest.raises(ModelMismatchError, match=r"ErrorDetector.predict_proba: the detector was made on another "
                                                 r"model \('zoo:add-3digit-weak'\): d_model 128 vs 32"):
        detector.predict_proba(narrow, task_prompts(narrow, "zoo:add-3digit-weak", 10, 0))
    assert detector.predict_proba(model, prompts[:10]).shape == (10,)


# --- engine.run ------------------------------------------------------------------------------------


@pytest.mark.parametrize("make, match", [
    (lambda T: dict(tokens=T.float()), r"tokens must hold integer token ids \(torch\.long\), got dtype torch\.float32"),
    (lambda T: dict(tokens=T + 1000), r"tokens hold the token id \d+, outside this model's vocabulary of 209 tokens"),
    (lambda T: dict(tokens=T.repeat(1, 8)), r"tokens are 40 tokens long, more than this model's context of 32 tokens"),
    (lambda T: dict(tokens=T[0]), r"tokens must be \[batch, pos\], got shape \(5,\)"),
    (lambda T: dict(reads=[("resid_post", 0, torch.full((len(T),), 1.0))]),
     r"positions must hold integer token indices, got a torch\.float32 tensor"),
    (lambda T: dict(writes=[("resid_post", 0, -1, torch.zeros(len(T), 7))]),
     r"intervention at resid_post layer 0: the value has shape \(\d+, 7\), which does not broadcast to the slice it "
     r"replaces, \(\d+, 64\)"),
    (lambda T: dict(writes=[("resid_post", 0, -1, lambda x: x[:, :3])]),
     r"the value function returned shape \(\d+, 3\)"),
])
def test_engine_run_refuses_what_it_cannot_run(tiny_model, make, match):
    from arithinterp import engine

    tokens = arithmetic(tiny_model, "+", range(4), range(4)).tokens
    spec = make(tokens)
    reads = [engine.Read(site, layer, positions=pos) for site, layer, pos in spec.get("reads", [])]
    writes = [engine.Write(site, layer, positions=pos, value=value) for site, layer, pos, value in spec.get("writes", [])]
    with pytest.raises(ArithInterpError, match=match):
        engine.run(tiny_model, spec.get("tokens", tokens), writes, reads)


def test_engine_run_takes_numpy_integer_positions(tiny_model):
    import numpy as np

    from arithinterp import engine

    tokens = arithmetic(tiny_model, "+", range(4), range(4)).tokens
    read = engine.run(tiny_model, tokens, reads=[engine.Read("resid_post", 0, positions=np.int64(-1))]).reads[0]  # pyright: ignore[reportArgumentType]
    same = engine.run(tiny_model, tokens, reads=[engine.Read("resid_post", 0, positions=-1)]).reads[0]
    assert torch.equal(read, same)
    with pytest.raises(ArithInterpError, match="writes and reads must be Write and Read objects, got str"):
        engine.run(tiny_model, tokens, reads=["resid_post"])  # pyright: ignore[reportArgumentType]


# --- probes before fit ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["LogisticProbe", "RidgeProbe", "CircularProbe", "MLPProbe"])
def test_probe_used_before_fit_raises_not_fitted(kind):
    from sklearn.exceptions import NotFittedError as SklearnNotFitted

    from arithinterp import probes

    with pytest.raises(probes.NotFittedError, match=f"this {kind} is not fitted yet; call fit\\(X, y\\) first") as error:
        getattr(probes, kind)().predict(torch.randn(4, 3))
    assert isinstance(error.value, SklearnNotFitted) and isinstance(error.value, ArithInterpError)


# --- positions and whole numbers ---------------------------------------------------------------------


def test_graph_positions_take_the_last_alias_and_refuse_all(tiny_model):
    from arithinterp import circuits

    pairs = _pairs(tiny_model)
    last = circuits.score_edges(tiny_model, pairs, "eap", positions=["a", "last"], progress=False)
    final = circuits.score_edges(tiny_model, pairs, "eap", positions=["a", "final"], progress=False)
    assert last.positions == final.positions and torch.equal(last.scores, final.scores)
    one = circuits.score_edges(tiny_model, pairs, "eap", positions="final", progress=False)
    assert set(one.positions) == {"final"}  # one string is one position, not its letters
    with pytest.raises(SiteError, match=r"a per-position graph needs the positions named, not 'all'"):
        circuits.score_edges(tiny_model, pairs, "eap", positions="all", progress=False)


@pytest.mark.parametrize("call", [
    lambda m, np: arithmetic(m, "+", range(3), range(3), few_shot=np.int64(1)),
    lambda m, np: arithmetic(m, "+", range(3), range(3), modulus=np.int64(7)),
    lambda m, np: arithmetic(m, "+", range(3), range(3)).evaluate(m, batch_size=np.int64(4)),
    lambda m, np: __import__("arithinterp").neurons.classify(m, arithmetic(m, "+", range(5), range(5)), layers=[0],
                                                             top_k=np.int64(3), batch_size=np.int32(8)),
    lambda m, np: __import__("arithinterp").patching.attribute(m, _pairs(m), "resid_pre", batch_size=np.int64(2)),
])
def test_numpy_integers_are_accepted_where_ints_are(tiny_model, call):
    import numpy as np

    assert call(tiny_model, np) is not None


@pytest.mark.parametrize("value, match", [
    (2.0, r"few_shot=2\.0 is not accepted .*few_shot accepts a non-negative int .* or a string"),
    (True, r"few_shot=True is not accepted .*few_shot accepts a non-negative int"),
    (-1, r"few_shot=-1 is not accepted .*few_shot accepts a non-negative int"),
])
def test_whole_numbers_are_never_truncated(tiny_model, value, match):
    with pytest.raises(ArithInterpError, match=match):
        arithmetic(tiny_model, "+", range(3), range(3), few_shot=value)


def test_collected_final_position_is_read_back_as_last(tiny_model):
    from arithinterp.activations import collect

    acts = collect(tiny_model, _prompts(tiny_model), positions=["last"], progress=False)
    assert acts.positions == ["final"]
    assert torch.equal(acts.get("resid_post", 1, "last"), acts.get("resid_post", 1, "final"))


def test_top_n_takes_a_numpy_integer(tiny_model):
    import numpy as np

    from arithinterp import circuits
    from arithinterp.errors import ConfigError

    circuit = circuits.score_edges(tiny_model, _pairs(tiny_model), "eap", progress=False)
    assert circuits.top_n(circuit, np.int64(5)).n_kept == 5  # pyright: ignore[reportArgumentType]
    with pytest.raises(ConfigError, match=r"top_n: n=2\.5 is not accepted .*n accepts a non-negative int"):
        circuits.top_n(circuit, 2.5)  # pyright: ignore[reportArgumentType]
    with pytest.raises(ConfigError, match=rf"n must be an integer in 0\.\.{circuit.n_edges} \(the number of edges\), "
                                          rf"got {circuit.n_edges + 1}"):
        circuits.top_n(circuit, circuit.n_edges + 1)


def test_something_that_is_not_pairs_is_refused_at_the_entry(tiny_model):
    from arithinterp import circuits, patching
    from arithinterp.errors import AnalysisError

    prompts = _prompts(tiny_model)
    with pytest.raises(AnalysisError, match=r"patching.activation_patching: pairs must be PromptPairs \(from "
                                            r"PromptSet.counterfactual\), got PromptSet"):
        patching.activation_patching(tiny_model, prompts, "resid_pre", progress=False)  # pyright: ignore[reportArgumentType]
    with pytest.raises(AnalysisError, match=r"circuits.score_edges: pairs must be PromptPairs .*got list"):
        circuits.score_edges(tiny_model, [prompts], "eap", progress=False)  # pyright: ignore[reportArgumentType]


@pytest.mark.parametrize("index", ["a", 1.5, [0.5], True, torch.tensor([0.0, 1.0])])
def test_a_prompt_set_is_never_indexed_by_a_string_float_or_bool(tiny_model, index):
    """``prompts[1.5]`` was row 1 and ``prompts[True]`` row 1, without a word; ``prompts["a"]`` a raw
    TypeError."""
    prompts = arithmetic(tiny_model, "+", range(10, 13), range(20, 23))
    with pytest.raises(TaskError, match="cannot be indexed by"):
        prompts[index]
    assert len(prompts[[]]) == 0 and prompts[np.int64(2)].texts == prompts[2].texts


@pytest.mark.parametrize("call, error", [
    (lambda p: p.str_tokens(99), "out of range"),
    (lambda p: p.str_tokens("a"), "i='a' is not accepted"),
    (lambda p: p.label("a_billionths"), "unknown label 'a_billionths'"),
    (lambda p: p.label("carry_18"), "carries are named by the column they go into: carry_tens .. carry_quintillions"),
    (lambda p: p.label(3), "name=3 is not accepted"),
    (lambda p: p.counterfactual("a", seed="1"), "seed='1' is not accepted"),
    (lambda p: p.counterfactual("a", max_tries=0), "max_tries=0 is not accepted"),
])
def test_prompt_set_methods_refuse_careless_arguments(tiny_model, call, error):
    """Each was a raw IndexError / OverflowError / TypeError, or (a string seed) silently accepted."""
    prompts = arithmetic(tiny_model, "+", range(10, 13), range(20, 23))
    with pytest.raises(ArithInterpError, match=error):
        call(prompts)


def test_a_huge_operand_range_is_refused_before_it_fills_memory(tiny_model):
    """``a=range(10**9)`` was listed in full (tens of GB) and the process was killed."""
    import itertools

    with pytest.raises(TaskError, match="more than 16,777,216 values"):
        arithmetic(tiny_model, "+", range(10**9), [2])
    with pytest.raises(TaskError, match="more than 16,777,216 values"):
        arithmetic(tiny_model, "+", itertools.count(), [2])
    with pytest.raises(TaskError, match=r"5,000 × 5,000 = 25,000,000 prompts"):
        arithmetic(tiny_model, "+", range(5000), range(5000))


@pytest.mark.parametrize("kwargs, match", [
    (dict(layers=[0, 0]), "names a layer more than once"),
    (dict(site="attn_z", heads=[1, -3]), "names one head more than once"),
    (dict(positions=["a", "a"]), "positions names 'a' more than once"),
])
def test_a_layer_or_head_named_twice_is_refused(tiny_model, kwargs, match):
    """A repeated layer, head or position was patched twice and reported as two rows or columns."""
    from arithinterp.patching import activation_patching

    pairs = arithmetic(tiny_model, "+", range(10, 16), range(20, 26)).counterfactual("a")[:4]
    kwargs = {"site": "resid_pre", **kwargs}
    with pytest.raises(SiteError, match=match):
        activation_patching(tiny_model, pairs, progress=False, **kwargs)


@pytest.mark.parametrize("returned, got", [
    (lambda logits: "high", "got str"),
    (lambda logits: logits[:, :2], r"got shape \(4, 2\)"),
    (lambda logits: logits[:, 0].to(torch.complex64), r"got shape \(4,\), torch.complex64"),
])
def test_a_metric_that_does_not_return_one_number_per_pair_is_refused(tiny_model, returned, got):
    """A metric callable returning a string gave a raw TypeError from deep in the scoring."""
    from arithinterp.errors import AnalysisError
    from arithinterp.patching import activation_patching

    pairs = arithmetic(tiny_model, "+", range(10, 16), range(20, 26)).counterfactual("a")[:4]
    with pytest.raises(AnalysisError, match=f"a metric callable must return one number per pair, shape \\[4\\]; {got}"):
        activation_patching(tiny_model, pairs, "resid_pre", layers=[0], metric=lambda logits, _: returned(logits),
                            progress=False)


def test_a_component_named_twice_is_refused(tiny_model):
    from arithinterp.errors import ConfigError
    from arithinterp.patching import direct_effect

    pairs = arithmetic(tiny_model, "+", range(10, 16), range(20, 26)).counterfactual("a")[:4]
    with pytest.raises(ConfigError, match=r"components names \['attn0'\] more than once"):
        direct_effect(tiny_model, pairs, components=["attn0", "attn0"], progress=False)


def test_more_interchange_pairs_than_the_prompts_make_is_refused(tiny_model):
    """``das --pairs 99999999999999999999`` drew pairs one by one for hours."""
    from arithinterp.causal import interchange_dataset
    from arithinterp.errors import ConfigError

    prompts = arithmetic(tiny_model, "+", range(10, 16), range(20, 26))
    with pytest.raises(ConfigError, match=r"n=99,999,999,999,999,999,999 is more pairs than the 36 prompts make"):
        interchange_dataset(prompts, "sum_mod_10", n=99999999999999999999, seed=0)



@pytest.mark.parametrize("call, error, match", [
    (lambda t: t.compute("/", 1, 2), ConfigError, "unknown operator '/'"),
    (lambda t: t.compute("+", "1", "2"), TaskError, "operands must be integers"),  # was the string '12'
    (lambda t: t.compute("+", 1.5, 2), TaskError, "operands must be integers"),  # was 3.5
    (lambda t: t.compute("mod", 7, 0), TaskError, "undefined: a division or remainder by zero"),
    (lambda t: t.answer_text(5, -1), TaskError, "answer_digits must be 0"),
    (lambda t: t.answer_text(9, 0, ["zero", "one"]), TaskError, "the answer 9 has no name"),
    (lambda t: t.few_shot_prefix(2, "^", "{a}+{b}=", [1], [2], None, 0), ConfigError, r"unknown operator '\^'"),
    (lambda t: t.few_shot_prefix(2, "+", "{a}+{b}=", [], [2], None, 0), TaskError, "need a value of a and a value of b"),
    (lambda t: t.few_shot_prefix(2, "//", "{a}{op}{b}=", [1], [0], None, 0), TaskError, "need a value of a and a value of b"),
])
def test_the_task_building_blocks_refuse_what_they_cannot_compute(call, error, match):
    """The exported helpers gave raw KeyError / IndexError / ValueError, a string sum, or looped for ever."""
    from arithinterp import tasks

    with pytest.raises(error, match=match):
        call(tasks)
