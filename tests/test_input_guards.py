"""Inputs that used to give a wrong answer without a word, or a raw traceback: each is now refused
with an ``ArithInterpError`` that names the problem."""

from __future__ import annotations

import pytest
import torch

from arithinterp.errors import ArithInterpError, SiteError, TaskError
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
    with pytest.raises(TaskError, match=r"unknown operator '\^' in ops; accepted: '\+', '-'"):
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

    with pytest.raises(SiteError, match=r"layers must be whole numbers \(ints\), got 0\.7 \(float\)"):
        collect(tiny_model, _prompts(tiny_model), layers=[0.7], progress=False)
    with pytest.raises(SiteError, match="layers must be an int or a list of ints, got the string"):
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
