"""Counterfactual partners: for each prompt, a corrupted prompt whose tokens align with it.

:meth:`PromptSet.counterfactual <arithinterp.tasks.PromptSet.counterfactual>` draws a partner per
prompt (:func:`draw_partners`), tokenizes the partners, and keeps the pairs whose token lengths and
positions agree (:func:`keep_aligned`).
"""

from __future__ import annotations

import random
import warnings
from typing import TYPE_CHECKING, Sequence

import torch

from arithinterp.errors import ConfigError, TaskError, accepted
from arithinterp.tasks.operators import OPERATORS, compute, defined
from arithinterp.tasks.templates import answer_text

if TYPE_CHECKING:
    from arithinterp.tasks.prompt_set import PromptSet

VARY = ("a", "b", "both", "keep-answer", "operator")


def draw_partners(
    prompts: PromptSet, vary: str, seed: int, ops: Sequence[str], max_tries: int
) -> tuple[list[int], list[tuple[int, int, str]]]:
    """Draw a corrupted ``(a, b, op)`` for each prompt, from the operand values present in ``prompts``.

    Args:
        prompts: The clean prompts (one template and prefix).
        vary: What the partner changes: ``"a"``, ``"b"``, ``"both"``, ``"keep-answer"`` or ``"operator"``.
        seed: The seed of the draws.
        ops: The operators ``vary="operator"`` draws from.
        max_tries: Draws per prompt before it is left without a partner.

    Returns:
        ``(rows, specs)``: the indices of the prompts that found a partner, and each partner's
        ``(a, b, op)``.

    Raises:
        ConfigError: ``vary`` or an operator is unknown.
        TaskError: the prompts join several templates or
            prefixes, ``vary="operator"`` has no ``{op}`` field or no other operator, or
            ``prompts`` is empty.
    """
    prompts.require_one_prefix("counterfactual()")
    assert prompts.template is not None  # require_one_prefix() refuses a set without one
    if vary not in VARY:
        raise ConfigError(f"unknown vary={vary!r}; accepted: {accepted(VARY)}")
    bad_ops = [op for op in ops if op not in OPERATORS] if not isinstance(ops, str) else [ops]
    if bad_ops:
        raise ConfigError(f"unknown operator {bad_ops[0]!r} in ops; accepted: {accepted(OPERATORS)}")
    if vary == "operator" and "{op}" not in prompts.template:
        # without an {op} field the corrupt prompts would be the clean text with other labels
        raise TaskError(
            f"vary='operator' needs the operator in the prompt text, but template {prompts.template!r} has no "
            "'{op}' field; build the prompts with a template such as '{a}{op}{b}='"
        )
    if len(prompts) == 0:
        raise TaskError("cannot build counterfactuals from an empty prompt set")
    rng = random.Random(seed)
    a_pool, b_pool = sorted(set(prompts.a.tolist())), sorted(set(prompts.b.tolist()))
    other_ops = [op for op in ops if op != prompts.op]
    if vary == "operator":
        if not other_ops:
            raise TaskError(f"vary='operator' needs another operator in ops; got {list(ops)}")
    tokenizer = prompts.tokenizer
    unk, digits, known = getattr(tokenizer, "unk_token_id", None), prompts.meta.get("answer_digits", 0), {}

    def spellable(value: int) -> bool:
        if unk is None:
            return True
        if value not in known:
            ids = tokenizer(answer_text(value, digits), add_special_tokens=False)["input_ids"]
            known[value] = unk not in ids
        return known[value]

    rows, specs = [], []
    for i, (a, b, answer) in enumerate(zip(prompts.a.tolist(), prompts.b.tolist(), prompts.answer.tolist())):
        for _ in range(max_tries):
            new_a, new_b, new_op = a, b, prompts.op
            if vary in ("a", "both", "keep-answer"):
                new_a = rng.choice(a_pool)
            if vary in ("b", "both", "keep-answer"):
                new_b = rng.choice(b_pool)
            if vary == "operator":
                new_op = rng.choice(other_ops)
            if (new_a, new_b, new_op) == (a, b, prompts.op) or not defined(new_op, new_b):
                continue
            new_answer = compute(new_op, new_a, new_b, prompts.modulus)
            if (new_answer == answer) != (vary == "keep-answer"):
                continue
            if not spellable(new_answer):  # e.g. a product past a number tokenizer's vocabulary
                continue
            rows.append(i)
            specs.append((new_a, new_b, new_op))
            break
    return rows, specs


def keep_aligned(
    n: int, clean: PromptSet, corrupt: PromptSet, vary: str, distinct_first_token: bool
) -> tuple[PromptSet, PromptSet, dict]:
    """Keep the pairs whose token lengths, operand positions and answer-token counts agree (and,
    with ``distinct_first_token``, whose answers start with different tokens).

    Pairs whose answers start with the same token are counted and warned about: a first-token
    metric is identically 0 on them.

    Args:
        n: How many prompts the pairs were drawn for (those without a partner count as dropped).
        clean: The clean prompts, one per partner.
        corrupt: Their partners, row for row.
        vary: What the partners change (``"keep-answer"`` keeps the answer on purpose).
        distinct_first_token: Keep only pairs whose answers start with different tokens.

    Returns:
        ``(clean, corrupt, meta)``: the kept pairs and ``meta`` with ``dropped``, ``kept`` and
        ``same_first_token``.

    Raises:
        TaskError: no pair is left.
    """
    aligned = _aligned(clean, corrupt)
    if distinct_first_token and vary != "keep-answer":
        aligned &= clean.answer_tokens[:, 0] != corrupt.answer_tokens[:, 0]
    clean, corrupt = clean[aligned], corrupt[aligned]
    dropped = n - len(clean)
    if len(clean) == 0:
        need = " and a different first answer token" if distinct_first_token else ""
        raise TaskError(
            f"no counterfactual partner with aligned tokens{need} could be found for vary={vary!r}; "
            "widen the operand ranges or use a tokenizer where the numbers are single tokens"
        )
    same = int((clean.answer_tokens[:, 0] == corrupt.answer_tokens[:, 0]).sum()) if vary != "keep-answer" else 0
    if same:
        warnings.warn(
            f"{same} of {len(clean)} pairs have clean and corrupt answers that start with the same first token, "
            "so a first-token logit difference is 0 on them; pass distinct_first_token=True, or score every "
            "answer token with prompts.with_scoring('full-answer')",
            stacklevel=3,  # the caller of PromptSet.counterfactual
        )
    return clean, corrupt, dict(dropped=dropped, kept=len(clean), same_first_token=same)


def _aligned(clean: PromptSet, corrupt: PromptSet) -> torch.Tensor:
    """Pairs whose token lengths, operand positions and answer-token counts agree."""
    same = (clean.lengths == corrupt.lengths) & (clean.n_answer_tokens == corrupt.n_answer_tokens)
    same &= clean.tokens.shape[1] == corrupt.tokens.shape[1]
    for name in clean.positions:
        same &= clean.positions[name] == corrupt.positions[name]
    return same
