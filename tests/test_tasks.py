"""PromptSet construction: positions from offsets, answers, labels, counterfactuals, validation."""

import re

import pytest
import torch

from arithinterp.errors import ArithInterpError, ConfigError, TaskError, TokenizationError
from arithinterp.tasks import arithmetic, number_check, prompts_for_pairs


def _token_text(prompts, i, position):
    return prompts.tokenizer.decode([int(prompts.tokens[i, position])]).strip()


def test_number_tokenizer_positions_and_answers(tiny_model):
    prompts = arithmetic(tiny_model, "+", range(20), range(20), "{a}+{b}=")
    assert len(prompts) == 400 and prompts.uniform_length
    for i in (0, 57, 399):
        assert prompts.str_tokens(i) == ["<bos>", str(int(prompts.a[i])), "+", str(int(prompts.b[i])), "="]
        assert _token_text(prompts, i, prompts.positions["a"][i]) == str(int(prompts.a[i]))
        assert _token_text(prompts, i, prompts.positions["b"][i]) == str(int(prompts.b[i]))
        assert prompts.positions["final"][i] == prompts.tokens.shape[1] - 1
        assert prompts.tokenizer.decode(prompts.answer_tokens[i].tolist()) == str(int(prompts.a[i] + prompts.b[i]))
    assert torch.equal(prompts.answer, prompts.a + prompts.b)


def test_digit_tokenizer_positions_multi_token_answers(digit_tokenizer):
    prompts = prompts_for_pairs(digit_tokenizer, "+", [123, 45, 999], [456, 7, 999], "{a}+{b}=")
    # operand position = the operand's last digit; lengths differ, so prompts are left-padded
    assert prompts.lengths.tolist() == [9, 6, 9]
    for i, (a, b) in enumerate([(123, 456), (45, 7), (999, 999)]):
        assert _token_text(prompts, i, prompts.positions["a"][i]) == str(a)[-1]
        assert _token_text(prompts, i, prompts.positions["b"][i]) == str(b)[-1]
        answer = prompts.answer_tokens[i][prompts.answer_tokens[i] >= 0].tolist()
        assert prompts.tokenizer.decode(answer).replace(" ", "") == str(a + b)
    assert prompts.meta["operand_tokens"]["max"] == 3
    assert prompts.meta["answer_tokens"] == dict(max=4, min=2)
    with pytest.raises(TokenizationError, match="single tokens"):
        prompts_for_pairs(digit_tokenizer, "+", [123], [456], "{a}+{b}=", require_single_tokens=True)


def test_bpe_tokenizer_positions(bpe_tokenizer):
    prompts = arithmetic(bpe_tokenizer, "+", [3, 27, 150, 399], [6, 42], "{a} plus {b}=")
    assert len(prompts) == 8
    for i in range(len(prompts)):
        row = prompts.tokens[i]
        for name, value in (("a", prompts.a[i]), ("b", prompts.b[i])):
            pos = int(prompts.positions[name][i])
            # the operand's tokens end exactly at its position: decoding up to it ends with the number
            prefix = bpe_tokenizer.decode(row[prompts.tokens.shape[1] - int(prompts.lengths[i]) : pos + 1].tolist())
            assert prefix.rstrip().endswith(str(int(value)))
            nxt = bpe_tokenizer.decode([int(row[pos + 1])])
            assert not nxt[:1].isdigit()
    check = number_check(bpe_tokenizer, range(400))
    assert check["single_token"] and check["multi_token"]  # a BPE vocabulary splits some numbers


def test_labels_digits_and_carries(tiny_model):
    prompts = prompts_for_pairs(tiny_model, "+", [57, 12, 99], [68, 3, 99], "{a}+{b}=")
    assert prompts.label("answer").tolist() == [125, 15, 198]
    assert prompts.label("answer_units").tolist() == [5, 5, 8]
    assert prompts.label("answer_hundreds").tolist() == [1, 0, 1]
    assert prompts.label("carry_tens").tolist() == [1, 0, 1]  # 7+8, 2+3, 9+9
    assert prompts.label("carry_hundreds").tolist() == [1, 0, 1]
    assert prompts.label("a_tens").tolist() == [5, 1, 9]
    assert "carry_units" not in prompts.label_names() and "carry_hundreds" in prompts.label_names()
    with pytest.raises(ConfigError, match="unknown label 'carry_units'"):  # nothing carries into the units
        prompts.label("carry_units")


@pytest.mark.parametrize("old, new", [("answer_digit_0", "'answer_units'"), ("a_digit_1", "'a_tens'"),
                                      ("sum_digit_2", "'answer_hundreds'"), ("carry_0", "'carry_tens'"),
                                      ("carry_1", "'carry_hundreds'"), ("a_digit_99", "a_units .. a_quintillions")])
def test_a_digit_numbered_by_index_is_refused_with_its_place_name(tiny_model, old, new):
    # one numbering: digits are named by their place, never by an index that could count either way
    prompts = prompts_for_pairs(tiny_model, "+", [57], [68], "{a}+{b}=")
    with pytest.raises(ConfigError, match=re.escape(new)):
        prompts.label(old)


def test_operators_and_modulus(tiny_model):
    assert arithmetic(tiny_model, "-", [9], [4]).answer.tolist() == [5]
    assert arithmetic(tiny_model, "*", [9], [4]).answer.tolist() == [36]
    div = arithmetic(tiny_model, "//", [9], [0, 4], "{a}/{b}=")
    assert div.answer.tolist() == [2] and div.meta["skipped"]["count"] == 1
    assert arithmetic(tiny_model, "mod", [9], [4], "{a} mod {b}=").answer.tolist() == [1]
    assert arithmetic(tiny_model, "+", [100], [50], "{a} {b} =", modulus=113).answer.tolist() == [37]


@pytest.mark.parametrize("vary", ["a", "b", "both", "keep-answer", "operator"])
def test_counterfactual_pairs_align(tiny_model, vary):
    prompts = arithmetic(tiny_model, "+", range(1, 30), range(1, 30), "{a}{op}{b}=")[::7]
    pairs = prompts.counterfactual(vary=vary, seed=1)
    assert len(pairs) == len(prompts) - pairs.meta["dropped"] and len(pairs) > 0
    clean, corrupt = pairs.clean, pairs.corrupt
    assert clean.tokens.shape == corrupt.tokens.shape
    for name in clean.positions:
        assert torch.equal(clean.positions[name], corrupt.positions[name])
    if vary == "a":
        assert torch.equal(clean.b, corrupt.b) and (clean.a != corrupt.a).all()
    if vary == "b":
        assert torch.equal(clean.a, corrupt.a) and (clean.b != corrupt.b).all()
    if vary == "keep-answer":
        assert torch.equal(clean.answer, corrupt.answer)
    else:
        assert (clean.answer != corrupt.answer).all()
    # deterministic
    again = prompts.counterfactual(vary=vary, seed=1)
    assert torch.equal(again.corrupt.tokens, corrupt.tokens)


def test_evaluate_and_correct_only(tiny_model):
    prompts = arithmetic(tiny_model, "+", range(10), range(10), "{a}+{b}=")
    evaluation = prompts.evaluate(tiny_model)
    logits = tiny_model(prompts.tokens)[:, -1]
    assert torch.equal(evaluation.generated_tokens[:, 0], logits.argmax(-1))
    assert torch.equal(evaluation.correct, logits.argmax(-1) == prompts.answer_tokens[:, 0])
    if evaluation.correct.any():
        kept = prompts.correct_only(tiny_model, evaluation)
        assert kept.meta["filtered"]["dropped"] == int((~evaluation.correct).sum())
    else:
        with pytest.raises(TaskError, match="none of these prompts"):
            prompts.correct_only(tiny_model, evaluation)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(op="^"), "unknown operator"),
        (dict(template="{a}+="), "must contain"),
        (dict(a=[]), "a is empty"),
        (dict(a=[500]), "does not know"),
        (dict(scoring="sum"), "unknown scoring"),
        (dict(modulus=1), r"prompts_for_pairs: modulus=1 is not accepted .*modulus accepts an int >= 2 .* or None"),
        (dict(answer_digits=-1), r"answer_digits=-1 is not accepted .*answer_digits accepts a non-negative int"),
    ],
)
def test_bad_input_is_rejected(tiny_model, kwargs, match):
    args = dict(op="+", a=[1], b=[2], template="{a}+{b}=") | kwargs
    with pytest.raises(ArithInterpError, match=match):
        arithmetic(tiny_model, **args)


def test_answer_merging_with_template_is_caught(number_tokenizer):
    # "3+4" then the answer "7" reads "3+47": the answer would merge into the operand token
    with pytest.raises(TokenizationError, match="merges"):
        arithmetic(number_tokenizer, "+", [3], [4], "{a}+{b}")


def test_few_shot_prefix(tiny_model):
    prompts = arithmetic(tiny_model, "+", [3, 4], [5], "{a}+{b}=", few_shot=3, seed=2)
    assert prompts.texts[0].count("\n") == 3
    assert _token_text(prompts, 0, prompts.positions["a"][0]) == "3"
    # each few-shot line is correct arithmetic
    for line in prompts.prefix.splitlines():
        left, right = line.split("=")
        x, y = left.split("+")
        assert int(x) + int(y) == int(right)


def test_answer_logprob_first_token_and_full_answer(tiny_digit_model):
    prompts = prompts_for_pairs(tiny_digit_model, "+", [123, 45], [456, 7], "{a}+{b}=")
    first = prompts.answer_logprob(tiny_digit_model)
    full = prompts.with_scoring("full-answer").answer_logprob(tiny_digit_model)
    assert prompts.with_scoring("full-answer").scoring == "full-answer"
    for i in range(len(prompts)):
        start = prompts.tokens.shape[1] - int(prompts.lengths[i])
        answer = prompts.answer_tokens[i][prompts.answer_tokens[i] >= 0]
        tokens = torch.cat([prompts.tokens[i, start:], answer])[None]
        logprobs = tiny_digit_model(tokens)[0].log_softmax(-1).detach()
        n = int(prompts.lengths[i])
        expected = sum(float(logprobs[n - 1 + j, answer[j]]) for j in range(len(answer)))
        assert full[i].item() == pytest.approx(expected, abs=1e-4)
        assert first[i].item() == pytest.approx(float(logprobs[n - 1, answer[0]]), abs=1e-4)
    assert (full <= first + 1e-6).all()  # more tokens, less probability


@pytest.mark.parametrize("tokenizer_name", ["number_tokenizer", "digit_tokenizer", "bpe_tokenizer"])
def test_locate_names_every_token_of_a_number(request, tokenizer_name):
    from arithinterp.errors import SiteError

    tokenizer = request.getfixturevalue(tokenizer_name)
    prompts = prompts_for_pairs(tokenizer, "+", [7, 47, 128, 150], [62, 5, 25, 3], "{a}+{b}=")
    labels, index = prompts.locate(["a[0]", "a", "a[-1]", "b[0]", "b", "final", "final-1", "last"])
    assert labels == ["a[0]", "a", "a[-1]", "b[0]", "b", "final", "final-1", "final"]
    assert index.shape == (4, 8)
    for i in range(len(prompts)):
        row = prompts.tokens[i].tolist()
        a_tokens = tokenizer.decode(row[int(index[i, 0]) : int(index[i, 1]) + 1]).replace(" ", "")
        b_tokens = tokenizer.decode(row[int(index[i, 3]) : int(index[i, 4]) + 1]).replace(" ", "")
        assert (a_tokens, b_tokens) == (str(int(prompts.a[i])), str(int(prompts.b[i])))
        assert index[i, 5] == prompts.tokens.shape[1] - 1 and index[i, 6] == index[i, 5] - 1
    assert torch.equal(index[:, 1], index[:, 2])  # a[-1] is a's last token
    if not prompts.uniform_length:  # integer positions would read a different token per prompt
        with pytest.raises(SiteError, match="different lengths"):
            prompts.locate(0)
    spans = (prompts.positions["a"] - prompts.positions["a[0]"] + 1).tolist()
    if max(spans) > 1:
        with pytest.raises(SiteError, match="token"):
            prompts.locate(f"a[{max(spans) - 1}]")  # not every a has that many tokens
    with pytest.raises(SiteError, match="outside the prompt"):
        prompts.locate("final+1")
    _, answer = prompts.locate("answer[0]", answers=1)
    assert torch.equal(answer[:, 0], prompts.positions["final"] + 1)
    with pytest.raises(SiteError):
        prompts.locate(1.5)


@pytest.mark.parametrize("tokenizer_name", ["number_tokenizer", "digit_tokenizer", "bpe_tokenizer"])
def test_reading_the_fast_tokenizer_directly_encodes_what_its_own_call_does(request, tokenizer_name, monkeypatch):
    """Prompts are tokenized through the Rust backend of a fast tokenizer; every field of the prompt set is
    what the tokenizer's own call gives, and a backend set to truncate is not read directly."""
    from arithinterp.tasks import encoding

    tokenizer = request.getfixturevalue(tokenizer_name)
    a, b = [3, 27, 15, 99, 8, 60], [6, 42, 7, 0, 31, 9]

    def build():
        return prompts_for_pairs(tokenizer, "+", a, b, "{a}+{b}=", few_shot=2, seed=1)

    assert encoding._direct_backend(tokenizer, ["1+2=", "30+4="]) is tokenizer.backend_tokenizer
    direct = build()
    monkeypatch.setattr(encoding, "_direct_backend", lambda tokenizer, texts: None)
    called = build()
    for field in ("tokens", "lengths", "answer_tokens", "a", "b", "answer"):
        assert torch.equal(getattr(direct, field), getattr(called, field)), field
    assert direct.positions.keys() == called.positions.keys()
    assert all(torch.equal(direct.positions[k], called.positions[k]) for k in direct.positions)
    assert direct.texts == called.texts and direct.meta == called.meta
    monkeypatch.undo()

    # the garbage collector, paused while prompts are encoded, runs again afterwards, also after an error
    import gc

    assert gc.isenabled()
    with pytest.raises(TaskError, match="does not fit in 64 bits"):
        prompts_for_pairs(tokenizer, "*", [2**62], [4], "{a}*{b}=")
    assert gc.isenabled()

    tokenizer.backend_tokenizer.enable_truncation(max_length=2)
    try:
        assert encoding._direct_backend(tokenizer, ["1+2="]) is None
    finally:
        tokenizer.backend_tokenizer.no_truncation()
