"""Joining prompt sets built with different few-shot prefixes, templates or token lengths.

The joined tokens are left-padded to the longest part and every position moves with its tokens,
so each position still points at its operand. :func:`~arithinterp.tasks.concat` joins sets or
pairs through :func:`join_sets`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from arithinterp.errors import TaskError
from arithinterp.tasks.encoding import pad_id

if TYPE_CHECKING:
    from arithinterp.tasks.prompt_set import PromptSet


def join_sets(parts: list[PromptSet]) -> PromptSet:
    """Join prompt sets into one, in order.

    Args:
        parts: At least one prompt set; all share the tokenizer, operator, modulus, scoring, BOS
            setting, answer writing and position names.

    Returns:
        One set of ``sum(len(p) for p in parts)`` prompts, left-padded to the longest part;
        ``meta["parts"]`` records each part's size, prefix and template, and ``prefix`` /
        ``template`` are ``None`` where the parts differ.

    Raises:
        TaskError: the parts differ in any of what they must share.
    """
    first = parts[0]
    for part in parts[1:]:
        for name in ("op", "modulus", "scoring", "prepend_bos"):
            if getattr(part, name) != getattr(first, name):
                what = "operator" if name == "op" else name
                raise TaskError(f"concat joins sets with the same {what}; "
                                f"got {getattr(first, name)!r} and {getattr(part, name)!r}")
        if part.meta.get("answer_digits", 0) != first.meta.get("answer_digits", 0):
            raise TaskError("concat joins sets whose answers are written alike; answer_digits differ")
        if part.meta.get("names") != first.meta.get("names"):
            raise TaskError("concat joins sets whose operands and answers are written alike; their names differ")
        if set(part.positions) != set(first.positions):
            raise TaskError(f"concat joins sets with the same positions; "
                            f"got {sorted(first.positions)} and {sorted(part.positions)}")
        if part.tokenizer is not first.tokenizer and part.tokenizer.get_vocab() != first.tokenizer.get_vocab():
            raise TaskError("concat joins sets built with the same tokenizer; "
                            "these tokenizers have different vocabularies")
    length = max(p.tokens.shape[1] for p in parts)
    k = max(p.answer_tokens.shape[1] for p in parts)
    pad = pad_id(first.tokenizer)
    padding = [torch.full((len(p), length - p.tokens.shape[1]), pad, dtype=torch.long) for p in parts]
    tokens = torch.cat([torch.cat([left, p.tokens], 1) for left, p in zip(padding, parts)])
    answer_tokens = torch.cat([torch.cat([p.answer_tokens, torch.full((len(p), k - p.answer_tokens.shape[1]), -1,
                                                                      dtype=torch.long)], 1) for p in parts])
    positions = {name: torch.cat([p.positions[name] + (length - p.tokens.shape[1]) for p in parts])
                 for name in first.positions}
    one = lambda values: values[0] if len(set(values)) == 1 else None  # noqa: E731
    n_answer = torch.cat([p.n_answer_tokens for p in parts])
    meta = dict(
        answer_digits=first.meta.get("answer_digits", 0),
        operand_tokens=dict(max=max(p.meta.get("operand_tokens", {}).get("max", 1) for p in parts)),
        answer_tokens=dict(max=k, min=int(n_answer.min()) if len(n_answer) else 0),
        n_digits=max(p.meta.get("n_digits", 1) for p in parts),
        parts=[dict(n=len(p), prefix=p.prefix, template=p.template) for p in parts],
    )
    if first.meta.get("names"):
        meta["names"] = first.meta["names"]
    return replace(
        first,
        texts=sum((p.texts for p in parts), ()),
        tokens=tokens,
        lengths=torch.cat([p.lengths for p in parts]),
        a=torch.cat([p.a for p in parts]),
        b=torch.cat([p.b for p in parts]),
        answer=torch.cat([p.answer for p in parts]),
        answer_tokens=answer_tokens,
        answer_texts=sum((p.answer_texts for p in parts), ()),
        positions=positions,
        template=one([p.template for p in parts]),
        prefix=one([p.prefix for p in parts]),
        meta=meta,
    )
