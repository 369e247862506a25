"""Joining prompt sets and pairs built with different few-shot prefixes; degenerate counterfactuals."""

from __future__ import annotations

import warnings

import pytest
import torch

from arithinterp.errors import TaskError
from arithinterp.tasks import PromptPairs, PromptSet, arithmetic, concat


def _token_text(prompts, i, position):
    return prompts.tokenizer.decode([int(prompts.tokens[i, position])]).strip()


def _parts(model):
    return [arithmetic(model, "+", range(1, 12), range(1, 6), "{a}+{b}=", few_shot=shots, seed=shots)
            for shots in (0, 2, 5)]


def test_concat_prompt_sets_keeps_positions_on_their_tokens(tiny_model):
    parts = _parts(tiny_model)
    assert len({p.tokens.shape[1] for p in parts}) == 3  # different lengths: positions must move
    joined = concat(parts)
    assert isinstance(joined, PromptSet) and len(joined) == sum(len(p) for p in parts)
    assert joined.tokens.shape[1] == max(p.tokens.shape[1] for p in parts)
    assert joined.texts == sum((p.texts for p in parts), ())
    assert torch.equal(joined.a, torch.cat([p.a for p in parts]))
    assert torch.equal(joined.answer_tokens, torch.cat([p.answer_tokens for p in parts]))
    for i in range(len(joined)):
        assert _token_text(joined, i, joined.positions["a"][i]) == str(int(joined.a[i]))
        assert _token_text(joined, i, joined.positions["b"][i]) == str(int(joined.b[i]))
        assert _token_text(joined, i, joined.positions["final"][i]) == "="
        assert joined.str_tokens(i)[-4:] == [str(int(joined.a[i])), "+", str(int(joined.b[i])), "="]
    # the unpadded tokens of every prompt are those of its part
    offset = 0
    for part in parts:
        for i in range(len(part)):
            assert joined.str_tokens(offset + i) == part.str_tokens(i)
        offset += len(part)
    assert joined.prefix is None and [p["n"] for p in joined.meta["parts"]] == [len(p) for p in parts]
    assert PromptSet.concat(parts).texts == joined.texts


def test_concat_prompt_sets_evaluates_like_its_parts(tiny_model):
    parts = _parts(tiny_model)
    joined = concat(parts)
    logprob = joined.answer_logprob(tiny_model)
    assert torch.allclose(logprob, torch.cat([p.answer_logprob(tiny_model) for p in parts]), atol=1e-5)


def test_concat_prompt_pairs_stay_aligned(tiny_model):
    parts = _parts(tiny_model)
    pair_parts = [p.counterfactual(vary="a", seed=3) for p in parts]
    joined = concat(pair_parts)
    assert isinstance(joined, PromptPairs) and len(joined) == sum(len(p) for p in pair_parts)
    assert joined.clean.tokens.shape == joined.corrupt.tokens.shape
    for name in joined.clean.positions:
        assert torch.equal(joined.clean.positions[name], joined.corrupt.positions[name])
    assert torch.equal(joined.clean.lengths, joined.corrupt.lengths)
    assert torch.equal(joined.corrupt.a, torch.cat([p.corrupt.a for p in pair_parts]))
    for i in range(len(joined)):
        assert _token_text(joined.corrupt, i, joined.corrupt.positions["a"][i]) == str(int(joined.corrupt.a[i]))
    assert PromptPairs.concat(pair_parts).corrupt.texts == joined.corrupt.texts


def test_concat_rejects_what_cannot_be_joined(tiny_model, tiny_digit_model):
    plus = arithmetic(tiny_model, "+", range(3), range(3))
    with pytest.raises(TaskError, match="at least one"):
        concat([])
    with pytest.raises(TaskError, match="operator"):
        concat([plus, arithmetic(tiny_model, "-", range(3), range(3), "{a}-{b}=")])
    with pytest.raises(TaskError, match="tokenizer"):
        concat([plus, arithmetic(tiny_digit_model, "+", range(3), range(3))])
    with pytest.raises(TaskError, match="PromptSet"):
        concat([plus, plus.counterfactual()])
    with pytest.raises(TaskError, match="each part"):  # mixed prefixes: counterfactuals per part, then concat
        concat(_parts(tiny_model)).counterfactual()


def test_counterfactual_warns_when_answers_share_their_first_token(tiny_digit_model):
    # digit tokens: 23+4=27 and 25+4=29 both start with "2", so a first-token logit difference is 0
    prompts = arithmetic(tiny_digit_model, "+", range(20, 40), range(1, 5), "{a}+{b}=")
    with pytest.warns(UserWarning, match=r"(\d+) of (\d+) pairs .* same first token") as record:
        pairs = prompts.counterfactual(vary="a", seed=0)
    same = int((pairs.clean_answer_token == pairs.corrupt_answer_token).sum())
    assert same > 0 and f"{same} of {len(pairs)} pairs" in str(record[0].message)
    assert pairs.meta["same_first_token"] == same

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        distinct = prompts.counterfactual(vary="a", seed=0, distinct_first_token=True)
    assert len(distinct) > 0 and (distinct.clean_answer_token != distinct.corrupt_answer_token).all()
    assert distinct.meta["same_first_token"] == 0


def test_counterfactual_on_single_token_answers_does_not_warn(tiny_model):
    prompts = arithmetic(tiny_model, "+", range(1, 20), range(1, 5), "{a}+{b}=")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pairs = prompts.counterfactual(vary="a", seed=0)
    assert pairs.meta["same_first_token"] == 0


def test_reasking_with_a_new_prefix_refuses_a_joined_set(tiny_model):
    from arithinterp.probes import few_shot_policy

    with pytest.raises(TaskError, match="each part"):
        few_shot_policy(2)(tiny_model, concat(_parts(tiny_model)))


@pytest.mark.parametrize("name", ["add-3digit", "add-100"])
def test_evaluate_on_the_zoo_decodes_through_the_stepper_with_the_plain_answers(name, monkeypatch):
    """The zoo (TransformerLens-native) decodes each answer token after the first at its own
    position with the stepper's key/value cache: the same answers as re-running the whole prompt
    per token, and the same teacher-forced scores."""
    import arithinterp as ai
    from arithinterp.engine import decode
    from arithinterp.errors import ModelFileError
    from arithinterp.models import zoo as zoo_lib

    try:
        model = ai.load_model(f"zoo:{name}")
    except ModelFileError:
        pytest.skip(f"zoo:{name} is not shipped in this checkout")
    prompts = zoo_lib.held_out_prompts(model, zoo_lib.get_entry(name), limit=300)
    stepped = prompts.evaluate(model)
    assert decode.decode_mode(model) == "stepped"
    scores = prompts.with_scoring("full-answer").answer_logprob(model)
    monkeypatch.setitem(decode._MODES, model, "full")  # the plain forward per answer token
    plain = prompts.evaluate(model)
    assert torch.equal(stepped.generated_tokens, plain.generated_tokens) and stepped.accuracy > 0.9
    assert torch.allclose(prompts.with_scoring("full-answer").answer_logprob(model), scores, atol=1e-5)


def test_ten_thousand_prompts_and_their_pairs_print_in_a_few_hundred_characters(tiny_model):
    """``repr`` says what the set is, its sizes and its first prompts, never every prompt; the notebook
    table shows the first rows and the total."""
    from test_result_contract import well_formed_html

    from arithinterp.printing import FIRST_ROWS, MAX_REPR

    small = arithmetic(tiny_model, "+", range(10), range(10), "{a}+{b}=")
    rows = torch.arange(10_000) % 100  # 10,000 prompts, without tokenizing 10,000 texts
    prompts, pairs = small[rows], small.counterfactual(vary="a", seed=0)[rows]
    for name, thing, first in (("PromptSet", prompts, "'0+0=0'"), ("PromptPairs", pairs, "'0+0= | ")):
        text = repr(thing)
        assert text.startswith(f"{name}(") and len(text) <= MAX_REPR and "=10000" in text and first in text, text
        page = thing._repr_html_()
        assert not well_formed_html(page) and f"<b>{name}</b>" in page and "10000 rows" in page
        assert page.count("<tr") == 2 + 1 + 1 + FIRST_ROWS  # what, sizes, the frame; its header and first rows
    assert "b='0..9'" in repr(prompts) and "answer='0..18'" in repr(prompts) and "vary='a'" in repr(pairs)
