"""The replacement model: every MLP swapped for its transcoder, no error term (Ameisen et al. 2025).

:func:`replacement_logits` runs it through the engine (each ``mlp_out`` replaced by the
transcoder of that forward's own ``mlp_in``, so later layers see earlier transcoders' outputs);
:func:`replacement_metrics` compares it with the real model at the positions that predict answer
tokens: top-1 agreement and the mean KL divergence KL(real ‖ replacement), in nats.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from arithinterp.engine import run
from arithinterp.engine.decode import batch_size_for
from arithinterp.errors import AnalysisError
from arithinterp.features.transcoder import Transcoders
from arithinterp.types import checked


@checked
def replacement_logits(model: Any, transcoders: Transcoders, tokens: torch.Tensor, n_last: int = 1,
                       edits: Optional[dict] = None) -> torch.Tensor:
    """The replacement model's logits: every MLP replaced by its transcoder.

    Args:
        model: The hooked model.
        transcoders: The transcoders.
        tokens (Int[Tensor, "batch pos"]): The prompts.
        n_last: The last positions read.
        edits: Feature edits per layer, see :meth:`Transcoders.interventions`.

    Returns:
        Float[Tensor, "batch n_last vocab"]: The logits.

    Raises:
        ModelMismatchError: Transcoders made for another model.
    """
    transcoders.check_model(model)
    out = run(model, tokens, transcoders.interventions(edits=edits), logits=n_last).logits  # those positions' alone
    assert out is not None
    return out


@checked
def replacement_metrics(model: Any, transcoders: Transcoders, tokens: torch.Tensor, n_last: int = 1,
                        batch_size: Optional[int] = None) -> dict[str, Any]:
    """How closely the replacement model follows the real one.

    Args:
        model: The hooked model.
        transcoders: The transcoders.
        tokens (Int[Tensor, "prompt pos"]): The prompts.
        n_last: The last positions compared.
        batch_size: Prompts per forward (default: what the engine's budget allows).

    Returns:
        ``agreement`` (top-1), ``kl`` (mean KL(real ‖ replacement)) and ``n_positions``.

    Raises:
        AnalysisError: No prompts.
    """
    if len(tokens) == 0:
        raise AnalysisError("no prompts to compare the replacement model on")
    size = batch_size or batch_size_for(model, int(tokens.shape[1]), n_read=n_last)
    agree, kl, count = 0, 0.0, 0
    for start in range(0, len(tokens), size):
        batch = tokens[start : start + size]
        real = run(model, batch, logits=n_last).logits
        assert real is not None
        repl = replacement_logits(model, transcoders, batch, n_last)
        agree += int((real.argmax(-1) == repl.argmax(-1)).sum())
        p_log, q_log = real.log_softmax(-1), repl.log_softmax(-1)
        kl += float((p_log.exp() * (p_log - q_log)).sum(-1).sum())
        count += real.shape[0] * real.shape[1]
    return dict(agreement=round(agree / count, 5), kl=round(kl / count, 5), n_positions=count)
