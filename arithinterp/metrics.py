"""Metrics on logits: logit difference, probability, log-prob, Stolfo's indirect effect, accuracy.

All take logits at the scored position, ``[batch, d_vocab]``, and token ids ``[batch]``, and
return per-example values ``[batch]``; call ``.mean()`` for the average.
"""

from __future__ import annotations

import torch
from jaxtyping import Float, Int
from torch import Tensor

from arithinterp.errors import AnalysisError


def _check(logits: torch.Tensor, *tokens: torch.Tensor) -> None:
    if logits.ndim != 2:
        raise AnalysisError(f"logits must be [batch, d_vocab], got shape {tuple(logits.shape)}")
    for t in tokens:
        if t.shape != (logits.shape[0],):
            raise AnalysisError(f"token ids must be [batch]={logits.shape[0]}, got shape {tuple(t.shape)}")


def _pick(values: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    return values.gather(-1, tokens.long()[:, None])[:, 0]


def logit_diff(
    logits: Float[Tensor, "batch vocab"], good: Int[Tensor, " batch"], bad: Int[Tensor, " batch"]
) -> Float[Tensor, " batch"]:
    """``logit[good] - logit[bad]`` per example: [batch]."""
    _check(logits, good, bad)
    return _pick(logits, good) - _pick(logits, bad)


def logit(logits: Float[Tensor, "batch vocab"], tokens: Int[Tensor, " batch"]) -> Float[Tensor, " batch"]:
    """The raw logit of ``tokens``: [batch]."""
    _check(logits, tokens)
    return _pick(logits, tokens)


def logprob(logits: Float[Tensor, "batch vocab"], tokens: Int[Tensor, " batch"]) -> Float[Tensor, " batch"]:
    """``log softmax(logits)[tokens]``: [batch]."""
    _check(logits, tokens)
    return _pick(logits.float().log_softmax(-1), tokens)


def prob(logits: Float[Tensor, "batch vocab"], tokens: Int[Tensor, " batch"]) -> Float[Tensor, " batch"]:
    """``softmax(logits)[tokens]``: [batch]."""
    return logprob(logits, tokens).exp()


def stolfo_ie(
    p_clean_before: Float[Tensor, " batch"],
    p_clean_after: Float[Tensor, " batch"],
    p_corrupt_before: Float[Tensor, " batch"],
    p_corrupt_after: Float[Tensor, " batch"],
) -> Float[Tensor, " batch"]:
    """Indirect effect of Stolfo et al. 2023, per example.

    ``IE = ½[(P*(r′) − P(r′)) / P(r′) + (P(r) − P*(r)) / P*(r)]`` with P before and P* after
    patching, r the clean answer and r′ the counterfactual answer. All inputs are [batch].
    """
    return 0.5 * (
        (p_corrupt_after - p_corrupt_before) / p_corrupt_before
        + (p_clean_before - p_clean_after) / p_clean_after
    )


def accuracy(predictions: torch.Tensor, targets: torch.Tensor) -> float:
    """Fraction of equal entries."""
    if predictions.shape != targets.shape:
        raise AnalysisError(
            f"predictions {tuple(predictions.shape)} and targets {tuple(targets.shape)} differ in shape"
        )
    if predictions.numel() == 0:
        raise AnalysisError("accuracy of an empty set is undefined")
    return float((predictions == targets).float().mean())
