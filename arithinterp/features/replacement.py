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
from arithinterp.progress import progress_bar

from arithinterp.checks import check_belongs
from arithinterp.drawing import draw
from arithinterp.engine import run
from arithinterp.engine.decode import batch_size_for
from arithinterp.errors import ConfigError
from arithinterp.features.rows import answer_sequences
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


@dataclass(frozen=True)
class ReplacementResult(Result):
    """How closely the replacement model follows the real one (:func:`replacement_metrics`), at
    every position that predicts an answer token.

    Attributes:
        agreement: The share of positions whose top token the two models agree on.
        kl: The mean KL(real ‖ replacement) over those positions, in nats.
        n_positions: The positions compared.
        agrees: ``[prompt, answer_position]`` 1.0 where the top tokens agree, 0.0 where not, NaN
            past a prompt's last answer token (answers of several lengths).
        kls: ``[prompt, answer_position]`` KL(real ‖ replacement) at each position (NaN past a
            prompt's last answer token).
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
        """One row per prompt and answer position it has: whether the top tokens agree, and the KL."""
        import pandas as pd

        prompt, position = (~self.kls.isnan()).nonzero(as_tuple=True)
        return pd.DataFrame(dict(prompt=prompt.tolist(), answer_position=position.tolist(),
                                 agree=self.agrees[prompt, position].bool().tolist(),
                                 kl=self.kls[prompt, position].tolist()))

    def plot(self, **kwargs: Any) -> go.Figure:
        """The KL per position, with the agreement in the title (see viz.features)."""
        return draw(self, **kwargs)


def compare_replacement(model: HookedModel, transcoders: Transcoders, tokens: torch.Tensor, n_last: int = 1,
                        batch_size: Optional[int] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-1 agreement and KL(real ‖ replacement) at the last ``n_last`` positions of token ids
    ``[N, T]`` of one length: the tensor path under :func:`replacement_metrics`.

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
                        batch_size: Optional[PositiveInt] = None, progress: bool = True) -> ReplacementResult:
    """How closely the replacement model follows the real one, at every position that predicts an
    answer token (each prompt followed by all but the last of its answer tokens, teacher-forced).

    Args:
        model: The hooked model.
        prompts: The prompts (answers of any token counts).
        transcoders: The transcoders.
        batch_size: Prompts per forward (default: what the engine's budget allows).
        progress: Show a progress bar.

    Returns:
        Top-1 agreement and mean KL(real ‖ replacement), overall and per position, as a
        :class:`ReplacementResult`.

    Raises:
        ConfigError: No prompts.
        ModelMismatchError: Prompts or transcoders made for another model.
    """
    check_belongs(model, "features.replacement_metrics", prompts=prompts)
    transcoders.check_model(model)
    if len(prompts) == 0:
        raise ConfigError("no prompts to compare the replacement model on")
    n_answer = int(prompts.n_answer_tokens.max())
    agrees = torch.full((len(prompts), n_answer), float("nan"))
    kls = torch.full((len(prompts), n_answer), float("nan"))
    # one run per sequence length and answer length (the last positions compared are the answer's)
    parts = [(group, n) for group in answer_sequences(prompts) for n in group.n_answer.unique().tolist()]
    for group, n in progress_bar(parts, desc="replacement model", disable=not progress):
        rows = (group.n_answer == n).nonzero().squeeze(1)
        agree, kl = compare_replacement(model, transcoders, group.tokens[rows], int(n), batch_size)
        agrees[group.prompts[rows], :n] = agree.float()
        kls[group.prompts[rows], :n] = kl.float()
    present = ~kls.isnan()
    return ReplacementResult(agreement=round(float(agrees[present].mean()), 5), kl=round(float(kls[present].mean()), 5),
                             n_positions=int(present.sum()), agrees=agrees, kls=kls,
                             meta=build_meta(model, n_prompts=len(prompts), n_answer=n_answer))
