"""Metrics on logits, and the one metric vocabulary of the package.

The functions take logits at the scored position, ``[batch, d_vocab]`` (or ``[*lead, batch,
d_vocab]``: stacked runs of the same batch), and token ids ``[batch]``, and return per-example
values ``[batch]`` (``[*lead, batch]``); call ``.mean()`` for the average.

Every analysis names its metric from one vocabulary:

* of a clean / corrupt pair (:data:`METRICS`): ``"logit_diff"`` (clean answer − corrupt answer
  logit), ``"prob"`` / ``"logprob"`` (of the clean answer), ``"ie"`` (Stolfo et al. 2023's
  indirect effect), or a callable ``f(logits [B, V], pairs) -> [B]``;
* of one prompt's own answer (:data:`ANSWER_METRICS`, when nothing is compared with a
  counterfactual): ``"logit"``, ``"logprob"``, ``"prob"``, ``"accuracy"``.

:func:`metric_fn` turns a pair metric into a function of stacked logits and a
:class:`MetricContext` (the batch's answer tokens, the base run's probabilities); patching,
attribution and the circuit analyses all score through it. ``DIRECTIONS`` says which prompt of a
pair is the base run: ``"denoise"`` patches clean activations into the corrupt run, ``"noise"``
the reverse.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Union

import torch
from jaxtyping import Float, Int
from torch import Tensor

from arithinterp.errors import AnalysisError, ConfigError, accepted

if TYPE_CHECKING:
    from arithinterp.tasks import PromptPairs

METRICS = ("logit_diff", "prob", "logprob", "ie")
ANSWER_METRICS = ("logit", "logprob", "prob", "accuracy")
DIRECTIONS = ("denoise", "noise")


def _check(logits: torch.Tensor, *tokens: torch.Tensor) -> None:
    if logits.ndim < 2:
        raise AnalysisError(f"logits must be [batch, d_vocab] (or [..., batch, d_vocab]), got shape "
                            f"{tuple(logits.shape)}")
    for t in tokens:
        if t.shape != (logits.shape[-2],):
            raise AnalysisError(f"token ids must be [batch]={logits.shape[-2]}, got shape {tuple(t.shape)}")


def pick(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``logits[..., b, tokens[b]]`` for logits ``[*lead, B, V]``: ``[*lead, B]``."""
    index = tokens.long().view(*([1] * (logits.ndim - 2)), -1, 1).expand(*logits.shape[:-1], 1)
    return logits.gather(-1, index)[..., 0]


def logit_diff(
    logits: Float[Tensor, "*lead batch vocab"], good: Int[Tensor, " batch"], bad: Int[Tensor, " batch"]
) -> Float[Tensor, "*lead batch"]:
    """``logit[good] - logit[bad]`` per example: [batch]."""
    _check(logits, good, bad)
    return pick(logits, good) - pick(logits, bad)


def logit(logits: Float[Tensor, "*lead batch vocab"], tokens: Int[Tensor, " batch"]) -> Float[Tensor, "*lead batch"]:
    """The raw logit of ``tokens``: [batch]."""
    _check(logits, tokens)
    return pick(logits, tokens)


def logprob(logits: Float[Tensor, "*lead batch vocab"], tokens: Int[Tensor, " batch"]) -> Float[Tensor, "*lead batch"]:
    """``log softmax(logits)[tokens]``: [batch]."""
    _check(logits, tokens)
    return pick(logits.float().log_softmax(-1), tokens)


def prob(logits: Float[Tensor, "*lead batch vocab"], tokens: Int[Tensor, " batch"]) -> Float[Tensor, "*lead batch"]:
    """``softmax(logits)[tokens]``: [batch]."""
    _check(logits, tokens)
    return pick(logits.float().softmax(-1), tokens)


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


@dataclass
class MetricContext:
    """What a metric needs about a batch of pairs: answer tokens and the base run's probabilities."""

    clean_tok: torch.Tensor  # [B]
    corrupt_tok: torch.Tensor  # [B]
    base_tok: torch.Tensor  # answer of the base (patched) prompt
    source_tok: torch.Tensor  # answer of the source prompt
    pairs: PromptPairs  # the PromptPairs batch, for user metrics
    base_p_base: Optional[torch.Tensor] = None  # P(base answer) in the unpatched base run
    base_p_source: Optional[torch.Tensor] = None  # P(source answer) in the unpatched base run


def metric_context(batch: PromptPairs, direction: str, base_logits: torch.Tensor, source_logits: torch.Tensor,
                   device=None) -> MetricContext:
    """What the metrics need for ``batch``, its tensors on ``device`` (the logits' device)."""
    clean_tok, corrupt_tok = batch.clean_answer_token, batch.corrupt_answer_token
    if device is not None:
        clean_tok, corrupt_tok = clean_tok.to(device), corrupt_tok.to(device)
    base_tok, source_tok = (corrupt_tok, clean_tok) if direction == "denoise" else (clean_tok, corrupt_tok)
    probs = base_logits.float().softmax(-1)
    return MetricContext(clean_tok, corrupt_tok, base_tok, source_tok, batch, pick(probs, base_tok),
                         pick(probs, source_tok))


def metric_fn(metric: Union[str, Callable]) -> Callable[[torch.Tensor, MetricContext], torch.Tensor]:
    """A function ``(logits [*lead, B, V], ctx) -> [*lead, B]`` for a metric of :data:`METRICS` or a callable
    ``f(logits [B, V], pairs) -> [B]`` (called once per stacked run)."""
    if callable(metric):

        def user(logits, ctx):
            flat = logits.reshape(-1, *logits.shape[-2:])
            out = []
            for chunk in flat:
                value = torch.as_tensor(metric(chunk, ctx.pairs))
                if value.shape != (chunk.shape[0],):
                    raise AnalysisError(
                        f"a metric callable must return one value per pair, shape [{chunk.shape[0]}]; "
                        f"got shape {tuple(value.shape)}"
                    )
                out.append(value.float())
            return torch.stack(out).reshape(logits.shape[:-1])

        return user
    if metric not in METRICS:
        raise ConfigError(
            f"unknown metric {metric!r}; accepted: {accepted(METRICS)} or a callable f(logits [B, V], pairs) -> [B]"
        )
    if metric == "logit_diff":
        return lambda logits, ctx: logit_diff(logits, ctx.clean_tok, ctx.corrupt_tok)
    if metric == "prob":
        return lambda logits, ctx: prob(logits, ctx.clean_tok)
    if metric == "logprob":
        return lambda logits, ctx: logprob(logits, ctx.clean_tok)

    def ie(logits, ctx):
        # Stolfo et al. 2023: r = the base prompt's answer, r' = the source prompt's answer
        probs = logits.float().softmax(-1)
        return stolfo_ie(ctx.base_p_base, pick(probs, ctx.base_tok), ctx.base_p_source, pick(probs, ctx.source_tok))

    return ie


def metric_name(metric: Union[str, Callable]) -> str:
    """The name a result records for ``metric`` (a callable's ``__name__``, else ``"custom"``)."""
    return metric if isinstance(metric, str) else getattr(metric, "__name__", "custom")
