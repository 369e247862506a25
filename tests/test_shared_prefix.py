"""Prompts that share their first tokens (a few-shot prefix) compute them once: in patching sweeps
without positions, in greedy decoding and in the error detector's reads. Every number is the one
the whole forwards give."""

from __future__ import annotations

import warnings

import pytest
import torch
from hf_families import FAMILIES, save_family
from test_real_models import plain_greedy

import arithinterp as ai
from arithinterp import patching, probes
from arithinterp.engine import decode, stepper_for
from arithinterp.engine.stepping import Stepper
from arithinterp.engine.steppers import read_last
from arithinterp.tasks import PromptSet, arithmetic

SHOTS = 3


@pytest.fixture(scope="module")
def llama(digit_tokenizer, tmp_path_factory):
    """A random 3-layer Llama folder (grouped-query attention, rotary, gated MLP) with digit tokens,
    and pairs whose prompts share a few-shot prefix and differ from the varied operand on."""
    folder = save_family("llama", digit_tokenizer, tmp_path_factory.mktemp("llama_prefix"), n_layers=3)
    model = ai.load_model(str(folder))
    prompts = arithmetic(model, a=range(10, 40), b=range(50, 60), few_shot=SHOTS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # first answer tokens shared by some pairs: "full-answer" scores them
        pairs = prompts.counterfactual(vary="a", seed=0)
    group = pairs.clean.length_groups()[0][:5]
    return model, prompts, pairs[group]


def _shared_length(tokens: torch.Tensor) -> int:
    same = (tokens == tokens[:1]).all(0)
    return int(same.int().argmin())


@pytest.fixture
def resume_starts(monkeypatch):
    """The positions every stepped patched run starts at (not the runs of the stepper's own check,
    which resumes mid-prompt on each new prompt length)."""
    starts, checking = [], []
    original, original_check = Stepper.resume, Stepper.check

    def spy(self, base, layer, hidden, start, *args, **kwargs):
        if not checking:
            starts.append(start)
        return original(self, base, layer, hidden, start, *args, **kwargs)

    def check(self, tokens):
        checking.append(True)
        try:
            return original_check(self, tokens)
        finally:
            checking.pop()

    original_split = Stepper.resume_split

    def split_spy(self, base, layer, first, rest, start, *args, **kwargs):
        starts.append(start)
        return original_split(self, base, layer, first, rest, start, *args, **kwargs)

    monkeypatch.setattr(Stepper, "resume", spy)
    monkeypatch.setattr(Stepper, "resume_split", split_spy)
    monkeypatch.setattr(Stepper, "check", check)
    return starts


# --- patching without positions -------------------------------------------------------------------


@pytest.mark.parametrize("scoring", ["first-token", "full-answer"])
@pytest.mark.parametrize("site", ["attn_z", "mlp_post", "attn_out", "pattern"])
def test_sweeps_without_positions_start_after_the_shared_prefix(llama, resume_starts, site, scoring):
    """Every cell patches every position, yet its run starts where the source activation first
    differs (after the prefix): the numbers are the whole forwards' (≤ 1e-5)."""
    model, _, pairs = llama
    units = dict(neurons=[3, 40, 100]) if site == "mlp_post" else {}
    every = torch.arange(len(pairs))
    tokens = torch.cat([pairs.clean.unpadded(every), pairs.corrupt.unpadded(every)])
    shared = _shared_length(tokens)
    assert shared >= 10 * SHOTS // 2  # the few-shot prefix and more
    stepper_for(model, tokens)  # the model's one-time check resumes mid-prompt too: not a sweep's run
    resume_starts.clear()
    fast = patching.activation_patching(model, pairs, site, per_position=False, scoring=scoring, engine="stepped",
                                        progress=False, **units)
    assert "keys/values reused" in fast.meta["engine"][0]
    assert resume_starts and min(resume_starts) >= shared, (shared, resume_starts)
    slow = patching.activation_patching(model, pairs, site, per_position=False, scoring=scoring, engine="hooks",
                                        progress=False, **units)
    assert fast.values.shape == slow.values.shape
    assert (fast.values - slow.values).abs().max() <= 1e-5 * max(1.0, float(slow.values.abs().max()))
    assert fast.values.std() > 1e-3  # the heads do move the metric: the comparison is not of constants


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_heads_without_positions_match_whole_forwards_in_every_family(family, number_tokenizer, tmp_path):
    model = ai.load_model(str(save_family(family, number_tokenizer, tmp_path)))
    prompts = arithmetic(model, a=range(10, 40, 3), b=range(5, 30, 4), few_shot=2)
    pairs = prompts.counterfactual(vary="b", seed=0, distinct_first_token=True)
    pairs = pairs[pairs.clean.length_groups()[0][:4]]
    for site in ("attn_z", "mlp_out"):
        fast = patching.activation_patching(model, pairs, site, per_position=False, engine="stepped", progress=False)
        assert "keys/values reused" in fast.meta["engine"][0], (family, fast.meta["engine"])
        slow = patching.activation_patching(model, pairs, site, per_position=False, engine="hooks", progress=False)
        assert (fast.values - slow.values).abs().max() <= 1e-5 * max(1.0, float(slow.values.abs().max())), family
        assert fast.values.std() > 1e-3


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_teacher_forced_answers_share_their_prompt_in_every_family(family, number_tokenizer, tmp_path, monkeypatch):
    """With ``full-answer`` scoring every pair is a row per fed answer; the patched runs compute the
    prompt's positions once per pair (``Stepper.resume_split``) and give the whole forwards' numbers
    (≤ 1e-5), for heads without positions and the residual stream by position (3 layers: a
    residual patch at layer 0 makes the run the source's, one entering the last block takes
    ``resume_last``)."""
    model = ai.load_model(str(save_family(family, number_tokenizer, tmp_path, n_layers=3)))
    prompts = arithmetic(model, a=range(10, 40, 3), b=range(5, 30, 4), few_shot=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # first answer tokens shared by some pairs: "full-answer" scores them
        pairs = prompts.counterfactual(vary="b", seed=0)
    pairs = pairs[pairs.clean.length_groups()[0][:4]]
    splits = []
    original = Stepper.resume_split

    def spy(self, *args, **kwargs):
        splits.append(args[4])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(Stepper, "resume_split", spy)
    for site, per_position in (("attn_z", False), ("resid_pre", True)):
        splits.clear()
        fast = patching.activation_patching(model, pairs, site, per_position=per_position, scoring="full-answer",
                                            engine="stepped", progress=False)
        assert splits, (family, site)  # the split path ran
        slow = patching.activation_patching(model, pairs, site, per_position=per_position, scoring="full-answer",
                                            engine="hooks", progress=False)
        assert (fast.values - slow.values).abs().max() <= 1e-5 * max(1.0, float(slow.values.abs().max())), family
        assert fast.values.std() > 1e-3


@pytest.mark.slow
def test_teacher_forced_sweeps_on_the_zoo_match_whole_forwards(monkeypatch):
    """The zoo's native attention through the split runs too; and an MLP neuron whose patch first
    changes anything after the first read position (inside the fed answer) is run from that read
    position, not refused."""
    from arithinterp.errors import ModelFileError
    from arithinterp.models import zoo as zoo_lib

    try:
        model = ai.load_model("zoo:add-3digit")
    except ModelFileError:
        pytest.skip("zoo:add-3digit is not shipped in this checkout")
    prompts = zoo_lib.held_out_prompts(model, zoo_lib.get_entry("add-3digit"), limit=40).with_scoring("full-answer")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        pairs = prompts.counterfactual(vary="b", seed=0)[:6]
    splits = []
    original = Stepper.resume_split
    monkeypatch.setattr(Stepper, "resume_split", lambda self, *a, **k: splits.append(a[4]) or original(self, *a, **k))
    for site, per_position in (("attn_z", False), ("resid_pre", True), ("mlp_post", False)):
        fast = patching.activation_patching(model, pairs, site, per_position=per_position, engine="stepped",
                                            progress=False)
        slow = patching.activation_patching(model, pairs, site, per_position=per_position, engine="hooks",
                                            progress=False)
        assert (fast.values - slow.values).abs().max() <= 1e-5 * max(1.0, float(slow.values.abs().max())), site
        assert fast.values.std() > 1e-3
    assert splits


def test_heads_without_positions_on_the_zoo_match_transformer_lens():
    from transformer_lens import patching as tl_patching

    from arithinterp.errors import ModelFileError

    try:
        model = ai.load_model("zoo:add-100")
    except ModelFileError:
        pytest.skip("zoo:add-100 is not shipped in this checkout")
    prompts = arithmetic(model, a=range(0, 100, 7), b=range(0, 100, 7)).correct_only(model)
    pairs = prompts.counterfactual("a", seed=0)[:24]
    ours = patching.activation_patching(model, pairs, "attn_z", per_position=False, progress=False)
    assert ours.meta["engine"][0].startswith("stepped")
    clean, corrupt = pairs.clean_answer_token, pairs.corrupt_answer_token

    def metric(logits):
        final = logits[:, -1]
        return final.gather(-1, clean[:, None])[:, 0] - final.gather(-1, corrupt[:, None])[:, 0]

    _, cache = model.run_with_cache(pairs.clean.tokens)
    reference = tl_patching.get_act_patch_attn_head_out_all_pos(model, pairs.corrupt.tokens, cache, metric,
                                                                reduce="none").values
    reference = reference.permute(-1, *range(reference.ndim - 1))  # pairs first
    assert ours.values.shape == reference.shape
    assert (ours.values - reference).abs().max() <= 1e-5 * max(1.0, float(reference.abs().max()))


def test_first_changed_is_where_the_source_differs(llama):
    """The runner's start for a cell that patches every position: the first position where any
    pair's source activation differs from its base one, the prompt length where none does."""
    model, _, pairs = llama
    from arithinterp.engine import PatchRunner

    idx = torch.arange(len(pairs))
    base, source = pairs.corrupt.unpadded(idx), pairs.clean.unpadded(idx)
    stepper, _ = stepper_for(model, base)
    runner = PatchRunner(model, stepper, "attn_z", base, source)
    differs = (base != source).any(0)
    first_token = int(differs.int().argmax())
    heads = torch.arange(model.cfg.n_heads)
    assert runner.first_changed(0, heads).tolist() == [first_token] * len(heads)
    same = PatchRunner(model, stepper, "attn_z", base, base)  # source = base: nothing changes anywhere
    assert same.first_changed(1, heads).tolist() == [base.shape[1]] * len(heads)
    with pytest.raises(ai.errors.AnalysisError, match="out of range"):
        runner.first_changed(model.cfg.n_layers, heads)


# --- decoding -------------------------------------------------------------------------------------


def test_greedy_decoding_runs_the_shared_prefix_once_and_gives_the_plain_answers(llama, monkeypatch):
    model, prompts, _ = llama
    prompts = prompts[:40]
    shared = []
    original = decode._prefix_step

    def spy(decoder, tokens, k, use_cache=True):
        shared.append((tokens.shape[0], k))
        return original(decoder, tokens, k, use_cache)

    monkeypatch.setattr(decode, "_prefix_step", spy)
    evaluation = prompts.evaluate(model)
    assert decode.decode_mode(model) == "cached" and decode._SHARES_PREFIX[model]
    # (the one-time check runs a 2-row probe this way too)
    assert sum(rows for rows, k in shared if k >= 10 * SHOTS // 2) == len(prompts), shared
    assert torch.equal(evaluation.generated_tokens, plain_greedy(model, prompts))
    # teacher-forced scoring takes the same path
    scored = prompts.with_scoring("full-answer")
    reference = torch.zeros(len(prompts))
    with torch.inference_mode():
        for group in prompts.length_groups():
            answer = scored.answer_tokens[group]
            fed = torch.cat([prompts.unpadded(group), answer[:, :-1].clamp(min=0)], dim=1)
            logprobs = model(fed, return_type="logits")[:, -answer.shape[1]:].float().log_softmax(-1)
            reference[group] = (logprobs.gather(-1, answer.clamp(min=0)[..., None])[..., 0] * (answer >= 0)).sum(-1)
    n_before = len(shared)
    assert torch.allclose(scored.answer_logprob(model), reference, atol=1e-4)
    assert len(shared) > n_before


@pytest.mark.slow
@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "llama"])
def test_greedy_decoding_with_a_shared_prefix_in_other_families(family, digit_tokenizer, tmp_path):
    """Learned and rotary positions, parallel blocks, Gemma 2's sliding window (16 tokens, shorter
    than these prompts): the prefix once gives the plain forward's answers."""
    model = ai.load_model(str(save_family(family, digit_tokenizer, tmp_path)))
    prompts = arithmetic(model, a=range(10, 60, 7), b=range(15, 60, 11), few_shot=2)
    assert prompts.tokens.shape[1] > 16
    assert torch.equal(prompts.evaluate(model).generated_tokens, plain_greedy(model, prompts))
    assert decode.decode_mode(model) == "cached" and decode._SHARES_PREFIX[model]


def test_prompts_without_a_shared_prefix_decode_row_by_row(llama):
    model, _, _ = llama
    tokens = torch.tensor([[5, 6, 7, 8], [9, 6, 7, 8]])
    assert decode._shared_length(tokens) == 0  # the first token differs
    assert decode._shared_length(tokens[:1]) == 0  # one row: nothing to share
    assert decode._shared_length(torch.tensor([[5, 6, 7, 8], [5, 6, 7, 9]])) == 3
    assert decode._shared_length(torch.tensor([[5, 6, 7, 8], [5, 6, 7, 9]]), n_read=2) == 2


# --- the error detector ---------------------------------------------------------------------------


def test_detector_reads_with_the_shared_prefix_equal_collects(llama):
    """The slot activations read with the prefix computed once are collect's (teacher-forced)."""
    model, prompts, _ = llama
    prompts = prompts[:30]
    evaluation = prompts.evaluate(model)
    for site in ("resid_post", "attn_z", "mlp_post"):
        fast = probes.slots.shared_prefix_slots(model, prompts, evaluation, site, [0, 2], batch_size=7)
        assert fast is not None
        slow = probes.answer_activations(model, prompts, evaluation, site, layers=[0, 2]).data[site]
        assert fast.shape == slow.shape
        assert (fast - slow).abs().max() <= 1e-5 * max(1.0, float(slow.abs().max())), site


def test_read_last_declines_rows_without_a_shared_prefix(llama, tiny_digit_model):
    model, _, _ = llama
    tokens = torch.randint(3, 20, (4, 12), generator=torch.Generator().manual_seed(0))
    assert read_last(model, tokens, ["blocks.0.hook_resid_post"], 2) is None  # nothing shared: whole forwards
    read = read_last(model, tokens, ["blocks.0.hook_resid_post"], 2, only_if_shared=False)
    assert read is not None and read["blocks.0.hook_resid_post"].shape == (4, 2, model.cfg.d_model)
    with pytest.raises(ai.errors.AnalysisError, match="n_last"):
        read_last(model, tokens, ["blocks.0.hook_resid_post"], 13)


@pytest.mark.slow
def test_detector_generates_once_per_prompt_set(llama, monkeypatch):
    """fit, evaluate, flag and predict_proba on one prompt set generate its answers once; another
    set, or changed weights, generates again."""
    from arithinterp.tasks import Evaluation

    model, prompts, _ = llama
    prompts = prompts[:60]
    tokenizer = model.tokenizer
    digit_ids = torch.tensor(tokenizer.convert_tokens_to_ids([str(i) for i in range(10)]))
    calls = []

    def planted(self, model, *args, **kwargs):  # every third answer off by one in its last digit, counted
        calls.append(len(self))
        wrong = torch.arange(len(self)) % 3 == 0
        generated = self.answer_tokens.clone()
        last = (generated[:, -1:] == digit_ids).int().argmax(1)
        generated[wrong, -1] = digit_ids[(last[wrong] + 1) % 10]
        answer = torch.where(wrong, self.answer - self.answer % 10 + (self.answer % 10 + 1) % 10, self.answer)
        return Evaluation(~wrong, answer, [str(x) for x in answer.tolist()], generated)

    monkeypatch.setattr(PromptSet, "evaluate", planted)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", probes.DetectorBaselineWarning)  # random weights: nothing to detect
        detector = probes.ErrorDetector(layers=[1, 2], cv=3).fit(model, prompts)
    assert calls == [60]
    result = detector.evaluate(model, prompts)
    detector.flag(model, prompts)
    detector.predict_proba(model, prompts)
    assert calls == [60] and torch.equal(result.correct, torch.arange(60) % 3 != 0)
    detector.evaluate(model, prompts[:30])  # another prompt set: its own answers
    assert calls == [60, 30]
    with torch.no_grad():  # new weights: new answers
        next(model.parameters()).add_(0.0)
    detector.flag(model, prompts)
    assert calls == [60, 30, 60]
    assert probes.slots.model_answers(model, prompts) is probes.slots.model_answers(model, prompts)
