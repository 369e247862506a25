"""The replacement model: every MLP swapped for its transcoder, no error term (Ameisen et al. 2025).

:func:`replacement_logits` runs it through the engine (each ``mlp_out`` replaced by the
transcoder of that forward's own ``mlp_in``, so later layers see earlier transcoders' outputs);
:func:`replacement_metrics` compares it with the real model at the positions that predict answer
tokens: top-1 agreement and the mean KL divergence KL(real ‖ replacement), in nats
(:class:`ReplacementResult`; :func:`compare_replacement` is the tensor path under it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from arithinterp.checks import check_belongs
from arithinterp.drawing import draw
from arithinterp.engine import run
from arithinterp.engine.decode import batch_size_for
from arithinterp.errors import AnalysisError, ConfigError
from arithinterp.features.transcoder import Transcoders
from arithinterp.results import NON_NEGATIVE, PROBABILITY, Result, build_meta
from arithinterp.tasks import PromptSet
from arithinterp.types import HookedModel, PositiveInt, checked

if TYPE_CHECKING:
    import pandas as pd
    import plotly.graph_objects as go


@checked
def replacement_logits(model: HookedModel, transcoders: Transcoders, tokens: torch.Tensor, n_last: int = 1,
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


def full_tokens(prompts: Any) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``tokens [N, T]`` (each prompt followed by all but its last answer token, so every answer
    token is predicted at some position), ``valid [N, T]`` (False on padding) and ``n_answer``,
    the number of final positions that predict answer tokens."""
    tokens, lengths = prompts.tokens, prompts.lengths
    n_answer = prompts.n_answer_tokens
    if len(prompts) == 0:
        raise AnalysisError("the prompt set is empty; transcoders need prompts to read activations from")
    if not bool((n_answer == n_answer[0]).all()):
        raise AnalysisError("prompts have answers of different token counts; pass prompts with one answer length")
    n = int(n_answer[0])
    if n > 1:
        tokens = torch.cat([tokens, prompts.answer_tokens[:, : n - 1]], 1)
        lengths = lengths + n - 1
    T = tokens.shape[1]
    valid = torch.arange(T)[None, :] >= (T - lengths)[:, None]  # left-padded frame
    return tokens, valid, n


@dataclass(frozen=True)
class ReplacementResult(Result):
    """How closely the replacement model follows the real one (:func:`replacement_metrics`), at
    every position that predicts an answer token.

    Attributes:
        agreement: The share of positions whose top token the two models agree on.
        kl: The mean KL(real ‖ replacement) over those positions, in nats.
        n_positions: The positions compared.
        agrees: ``[prompt, answer_position]`` whether the top tokens agree.
        kls: ``[prompt, answer_position]`` KL(real ‖ replacement) at each position.
        meta: Provenance.
    """

    agreement: float
    kl: float
    n_positions: int
    agrees: torch.Tensor
    kls: torch.Tensor
    meta: dict

    # what load checks: the axes fields share and the values they may take
    _shapes = {"agrees": "prompt answer", "kls": "prompt answer"}
    _legal = {"agreement": PROBABILITY, "kl": NON_NEGATIVE, "n_positions": NON_NEGATIVE}

    def as_dict(self) -> dict[str, Any]:
        """``agreement``, ``kl`` and ``n_positions``, as a transcoder set's metrics record them."""
        return dict(agreement=self.agreement, kl=self.kl, n_positions=self.n_positions)

    def to_frame(self) -> pd.DataFrame:
        """One row per prompt and answer position: whether the top tokens agree, and the KL."""
        import pandas as pd

        n, k = self.kls.shape
        return pd.DataFrame(dict(prompt=[i for i in range(n) for _ in range(k)],
                                 answer_position=[j for _ in range(n) for j in range(k)],
                                 agree=self.agrees.reshape(-1).tolist(), kl=self.kls.reshape(-1).tolist()))

    def plot(self, **kwargs: Any) -> go.Figure:
        """The KL per position, with the agreement in the title (see viz.features)."""
        return draw(self, **kwargs)


def compare_replacement(model: HookedModel, transcoders: Transcoders, tokens: torch.Tensor, n_last: int = 1,
                        batch_size: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-1 agreement and KL(real ‖ replacement) at the last ``n_last`` positions of token ids
    ``[N, T]``: the tensor path under :func:`replacement_metrics`.

    Args:
        model: The hooked model.
        transcoders: The transcoders.
        tokens (Int[Tensor, "prompt pos"]): The prompts.
        n_last: The last positions compared.
        batch_size: Prompts per forward (default: what the engine's budget allows).

    Returns:
        ``(agrees, kls)``, each ``[prompt, n_last]``.

    Raises:
        ConfigError: No prompts.
    """
    if len(tokens) == 0:
        raise ConfigError("no prompts to compare the replacement model on")
    size = batch_size or batch_size_for(model, int(tokens.shape[1]), n_read=n_last)
    agrees, kls = [], []
    for start in range(0, len(tokens), size):
        batch = tokens[start : start + size]
        real = run(model, batch, logits=n_last).logits
        assert real is not None
        repl = replacement_logits(model, transcoders, batch, n_last)
        real, repl = real.reshape(len(batch), n_last, -1), repl.reshape(len(batch), n_last, -1)
        agrees.append((real.argmax(-1) == repl.argmax(-1)).cpu())
        p_log, q_log = real.float().log_softmax(-1), repl.float().log_softmax(-1)
        kls.append((p_log.exp() * (p_log - q_log)).sum(-1).clamp(min=0).cpu())
    return torch.cat(agrees), torch.cat(kls)


@checked
def replacement_metrics(model: HookedModel, prompts: PromptSet, transcoders: Transcoders, *,
                        batch_size: Optional[PositiveInt] = None) -> ReplacementResult:
    """How closely the replacement model follows the real one, at every position that predicts an
    answer token (each prompt followed by all but the last of its answer tokens, teacher-forced).

    Args:
        model: The hooked model.
        prompts: The prompts, their answers of one token count.
        transcoders: The transcoders.
        batch_size: Prompts per forward (default: what the engine's budget allows).

    Returns:
        Top-1 agreement and mean KL(real ‖ replacement), overall and per position, as a
        :class:`ReplacementResult`.

    Raises:
        ConfigError: No prompts.
        AnalysisError: Answers of different token counts.
        ModelMismatchError: Prompts or transcoders made for another model.
    """
    check_belongs(model, "features.replacement_metrics", prompts=prompts)
    transcoders.check_model(model)
    if len(prompts) == 0:
        raise ConfigError("no prompts to compare the replacement model on")
    tokens, _, n_answer = full_tokens(prompts)
    agrees, kls = compare_replacement(model, transcoders, tokens, n_answer, batch_size)
    count = agrees.numel()
    return ReplacementResult(agreement=round(float(agrees.float().mean()), 5), kl=round(float(kls.mean()), 5),
                             n_positions=count, agrees=agrees, kls=kls.float(),
                             meta=build_meta(model, n_prompts=len(prompts), n_answer=n_answer))
