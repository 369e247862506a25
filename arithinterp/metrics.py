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
# the pair metrics that read a few answer tokens' logits, no softmax over the vocabulary: their
# logits may be computed at those tokens' columns alone (answer_columns)
LOGIT_METRICS = ("logit_diff",)
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
    """Each example's logit of its own token: ``logits[..., b, tokens[b]]``.

    Args:
        logits (Float[Tensor, "*lead batch vocab"]): Logits (or probabilities) at the scored position.
        tokens (Int[Tensor, "batch"]): One token id per example.

    Returns:
        Float[Tensor, "*lead batch"]: The picked entries.
    """
    index = tokens.long().view(*([1] * (logits.ndim - 2)), -1, 1).expand(*logits.shape[:-1], 1)
    return logits.gather(-1, index)[..., 0]


def logit_diff(
    logits: Float[Tensor, "*lead batch vocab"], good: Int[Tensor, " batch"], bad: Int[Tensor, " batch"]
) -> Float[Tensor, "*lead batch"]:
    """``logit[good] - logit[bad]`` per example.

    Args:
        logits: Logits at the scored position.
        good: The token whose logit counts positively (the clean answer).
        bad: The token whose logit counts negatively (the corrupt answer).

    Returns:
        The logit difference per example.

    Raises:
        AnalysisError: ``logits`` has fewer than two axes or the token ids are not ``[batch]``.
    """
    _check(logits, good, bad)
    return pick(logits, good) - pick(logits, bad)


def logit(logits: Float[Tensor, "*lead batch vocab"], tokens: Int[Tensor, " batch"]) -> Float[Tensor, "*lead batch"]:
    """The raw logit of each example's token.

    Args:
        logits: Logits at the scored position.
        tokens: One token id per example.

    Returns:
        The logit per example.

    Raises:
        AnalysisError: ``logits`` has fewer than two axes or ``tokens`` is not ``[batch]``.
    """
    _check(logits, tokens)
    return pick(logits, tokens)


def logprob(logits: Float[Tensor, "*lead batch vocab"], tokens: Int[Tensor, " batch"]) -> Float[Tensor, "*lead batch"]:
    """``log_softmax(logits)[tokens]`` per example, computed in float32.

    Args:
        logits: Logits at the scored position.
        tokens: One token id per example.

    Returns:
        The log-probability of each example's token.

    Raises:
        AnalysisError: ``logits`` has fewer than two axes or ``tokens`` is not ``[batch]``.
    """
    _check(logits, tokens)
    return pick(logits.float().log_softmax(-1), tokens)


def prob(logits: Float[Tensor, "*lead batch vocab"], tokens: Int[Tensor, " batch"]) -> Float[Tensor, "*lead batch"]:
    """``softmax(logits)[tokens]`` per example, computed in float32.

    Args:
        logits: Logits at the scored position.
        tokens: One token id per example.

    Returns:
        The probability of each example's token.

    Raises:
        AnalysisError: ``logits`` has fewer than two axes or ``tokens`` is not ``[batch]``.
    """
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
    patching, r the clean answer and r′ the counterfactual answer.

    Args:
        p_clean_before: P(r), the clean answer's probability in the unpatched run.
        p_clean_after: P*(r), the clean answer's probability in the patched run.
        p_corrupt_before: P(r′), the counterfactual answer's probability in the unpatched run.
        p_corrupt_after: P*(r′), the counterfactual answer's probability in the patched run.

    Returns:
        The indirect effect per example.
    """
    return 0.5 * (
        (p_corrupt_after - p_corrupt_before) / p_corrupt_before
        + (p_clean_before - p_clean_after) / p_clean_after
    )


def accuracy(predictions: torch.Tensor, targets: torch.Tensor) -> float:
    """The fraction of equal entries.

    Args:
        predictions: Predicted values, any shape.
        targets: True values, the shape of ``predictions``.

    Returns:
        The fraction of positions where they agree, in ``[0, 1]``.

    Raises:
        AnalysisError: The shapes differ or the tensors are empty.
    """
    if predictions.shape != targets.shape:
        raise AnalysisError(
            f"predictions {tuple(predictions.shape)} and targets {tuple(targets.shape)} differ in shape"
        )
    if predictions.numel() == 0:
        raise AnalysisError("accuracy of an empty set is undefined")
    return float((predictions == targets).float().mean())


@dataclass
class MetricContext:
    """What a metric needs about a batch of pairs: answer tokens and the base run's probabilities.

    Attributes:
        clean_tok (Int[Tensor, "batch"]): The clean prompts' answer tokens.
        corrupt_tok (Int[Tensor, "batch"]): The corrupt prompts' answer tokens.
        base_tok (Int[Tensor, "batch"]): The answer of the base (patched) prompt.
        source_tok (Int[Tensor, "batch"]): The answer of the source prompt.
        pairs (PromptPairs): The batch of pairs, for user metrics.
        base_p_base (Float[Tensor, "batch"] | None): P(base answer) in the unpatched base run.
        base_p_source (Float[Tensor, "batch"] | None): P(source answer) in the unpatched base run.
    """

    clean_tok: torch.Tensor
    corrupt_tok: torch.Tensor
    base_tok: torch.Tensor
    source_tok: torch.Tensor
    pairs: PromptPairs
    base_p_base: Optional[torch.Tensor] = None
    base_p_source: Optional[torch.Tensor] = None


def answer_columns(*tokens: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The distinct token ids among ``tokens`` (sorted) and each tensor's ids as indices into them.

    Logits computed at those vocabulary columns alone (``engine.PatchRunner(..., columns=)``)
    are read with the indices as whole-vocabulary logits are read with the ids: on a 262,144-token
    vocabulary a logit difference then needs a handful of columns, not all of them.

    Args:
        tokens (Int[Tensor, "batch"]): Token ids, one tensor per role (clean and corrupt answers).

    Returns:
        ``(columns [U], [indices [batch] per tensor])``.
    """
    columns, inverse = torch.unique(torch.cat([t.long().flatten() for t in tokens]), return_inverse=True)
    return columns, list(inverse.split([t.numel() for t in tokens]))


def metric_context(batch: PromptPairs, direction: str, base_logits: torch.Tensor, source_logits: torch.Tensor,
                   device=None, columns: Optional[torch.Tensor] = None) -> MetricContext:
    """What the metrics need for a batch of pairs.

    Args:
        batch (PromptPairs): The pairs.
        direction: ``"denoise"`` (the corrupt prompt is the base run) or ``"noise"`` (the clean one is).
        base_logits (Float[Tensor, "batch vocab"]): The unpatched base run's logits at the scored position.
        source_logits (Float[Tensor, "batch vocab"]): The source run's logits (unused by the built-in
            metrics).
        device: Where to put the answer tokens (the logits' device); ``None`` leaves them where they are.
        columns (Int[Tensor, "U"] | None): The vocabulary columns the logits hold (sorted,
            :func:`answer_columns`): the answer tokens become indices into them, and the base run's
            probabilities, which need the whole vocabulary, are left out (only the
            :data:`LOGIT_METRICS` read such logits).

    Returns:
        The context, with the base run's probabilities of both answers (without ``columns``).
    """
    clean_tok, corrupt_tok = batch.clean_answer_token, batch.corrupt_answer_token
    if columns is not None:
        clean_tok, corrupt_tok = (torch.searchsorted(columns, t.long().contiguous()) for t in (clean_tok, corrupt_tok))
    if device is not None:
        clean_tok, corrupt_tok = clean_tok.to(device), corrupt_tok.to(device)
    base_tok, source_tok = (corrupt_tok, clean_tok) if direction == "denoise" else (clean_tok, corrupt_tok)
    if columns is not None:
        return MetricContext(clean_tok, corrupt_tok, base_tok, source_tok, batch)
    probs = base_logits.float().softmax(-1)
    return MetricContext(clean_tok, corrupt_tok, base_tok, source_tok, batch, pick(probs, base_tok),
                         pick(probs, source_tok))


def metric_fn(metric: Union[str, Callable]) -> Callable[[torch.Tensor, MetricContext], torch.Tensor]:
    """The scoring function of a pair metric.

    Args:
        metric: A name of :data:`METRICS`, or a callable ``f(logits [batch, vocab], pairs) -> [batch]``
            (called once per stacked run).

    Returns:
        A function ``(logits [*lead, batch, vocab], ctx: MetricContext) -> [*lead, batch]``.

    Raises:
        ConfigError: ``metric`` is neither a known name nor a callable.
    """
    if callable(metric):

        def user(logits, ctx):
            flat = logits.reshape(-1, *logits.shape[-2:])
            out = []
            for chunk in flat:
                returned = metric(chunk, ctx.pairs)
                try:
                    value = torch.as_tensor(returned)
                except (TypeError, ValueError, RuntimeError):
                    value = None
                if value is None or value.shape != (chunk.shape[0],) or value.is_complex():
                    got = f"shape {tuple(value.shape)}, {value.dtype}" if value is not None else type(returned).__name__
                    raise AnalysisError(
                        f"a metric callable must return one number per pair, shape [{chunk.shape[0]}]; got {got}"
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
    """The name a result records for a metric.

    Args:
        metric: A metric name or a callable.

    Returns:
        The name itself, a callable's ``__name__``, or ``"custom"`` when it has none.
    """
    return metric if isinstance(metric, str) else getattr(metric, "__name__", "custom")
