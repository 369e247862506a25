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
    with pytest.raises(TaskError, match=r"the model's context \(n_ctx\) is 16 tokens; use fewer few_shot examples"):
        arithmetic(model, "+", a=range(3), b=range(3), few_shot=5)
    assert len(arithmetic(model, "+", a=range(3), b=range(3), few_shot=1)) == 9
