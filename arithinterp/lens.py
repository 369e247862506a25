"""The logit lens: how early the answer can be read out of the residual stream.

Each layer's residual stream (``resid_post``) at each position is passed through the model's own end
— its final norm, the unembedding and any logit soft-cap — as if the layers after it were skipped
(nostalgebraist 2020): :func:`logit_lens` gives the answer token's probability and rank there.
At the final prompt token and at the answer tokens fed after it, the answer token is the one the
model writes next; before the final token it is the answer's first token (how early the answer is
readable). The last layer's lens is the model's own output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Sequence, Union

import torch

from arithinterp import sites as site_lib
from arithinterp.activations import collect
from arithinterp.checks import check_belongs
from arithinterp.drawing import draw
from arithinterp.engine import Stepper
from arithinterp.errors import AnalysisError, SiteError
from arithinterp.progress import progress_bar
from arithinterp.results import NON_NEGATIVE, PROBABILITY, Result, build_meta
from arithinterp.types import PositiveInt, checked

if TYPE_CHECKING:
    from arithinterp.tasks import PromptSet
    from arithinterp.types import HookedModel

__all__ = ["LogitLensResult", "logit_lens"]

FLOATS_PER_STEP = 1 << 26  # residual streams read, or logits unembedded, at once (256 MB in float32)


@dataclass(frozen=True)
class LogitLensResult(Result):
    """The answer token's probability and rank under the logit lens, per prompt, layer and position.

    Attributes:
        probability (Float[Tensor, "prompt layer position"]): The softmax probability of the answer
            token (NaN where a prompt's answer has no token to predict at that position).
        rank (Float[Tensor, "prompt layer position"]): How many vocabulary entries have a larger
            logit (0: the lens's top prediction; NaN as above).
        answer_tokens (Int[Tensor, "prompt position"]): The token scored at each position (-1: none).
        layers: The layer of each index on axis 1 (its ``resid_post``).
        positions: The position specs on axis 2.
        tokens: The first prompt's token at each position.
        meta: Provenance (:func:`arithinterp.results.build_meta`) and the arguments.
    """

    probability: torch.Tensor
    rank: torch.Tensor
    answer_tokens: torch.Tensor
    layers: list
    positions: list
    tokens: list
    meta: dict

    # what load checks: the axes fields share and the values they may take
    _shapes = {"probability": "prompt layer position", "rank": "prompt layer position",
               "answer_tokens": "prompt position", "layers": "layer", "positions": "position", "tokens": "position"}
    _legal = {"probability": PROBABILITY, "rank": NON_NEGATIVE, "layers": NON_NEGATIVE}

    def headline(self) -> dict:
        """At the last position: the first layer where the answer is the lens's top token for most
        prompts, and the last layer's mean probability and top-1 share.

        Returns:
            ``position``, ``top1_from_layer`` (``None`` when never), ``last_layer_probability`` and
            ``last_layer_top1``.
        """
        top1 = (self.rank[:, :, -1] == 0).float().mean(0)
        first = next((layer for layer, share in zip(self.layers, top1.tolist()) if share > 0.5), None)
        return dict(position=self.positions[-1], top1_from_layer=first,
                    last_layer_probability=float(self.probability[:, -1, -1].nanmean()),
                    last_layer_top1=float(top1[-1]))

    def to_frame(self):
        """One row per layer × position: the answer's mean probability, median rank, the share of
        prompts where it is the top token, and how many prompts have an answer token there."""
        import pandas as pd

        scored = ~self.rank.isnan()
        n = scored.sum(0)
        top1 = ((self.rank == 0) & scored).sum(0) / n.clamp(min=1)
        median = self.rank.nanmedian(0).values
        rows = [dict(layer=layer, position=position, token=self.tokens[j],
                     mean_probability=float(self.probability[:, i, j].nanmean()),
                     median_rank=float(median[i, j]), top1=float(top1[i, j]) if n[i, j] else math.nan,
                     n_prompts=int(n[i, j]))
                for i, layer in enumerate(self.layers) for j, position in enumerate(self.positions)]
        return pd.DataFrame(rows)

    def plot(self, **kwargs):
        """Layer × position heatmap of the answer's mean probability (median rank on hover), or the
        probability and top-1 share over layers for one position.

        Args:
            **kwargs: Options of :func:`arithinterp.viz.lens.plot_logit_lens`.

        Returns:
            The plotly figure.
        """
        return draw(self, **kwargs)


def _answer_tokens(prompts: PromptSet, columns: torch.Tensor) -> torch.Tensor:
    """The token each read position predicts: the answer token written next at and after the final
    prompt token, the first answer token before it (``columns [N, P]`` in the padded frame; -1: none)."""
    final = prompts.positions["final"][:, None]
    k = (columns - final).clamp(min=0)
    K = prompts.answer_tokens.shape[1]
    return torch.where(k < K, prompts.answer_tokens.gather(1, k.clamp(max=K - 1)), torch.full_like(k, -1))


@checked
def logit_lens(
    model: HookedModel,
    prompts: PromptSet,
    *,
    layers: Optional[Sequence[int]] = None,
    positions: Union[str, int, Sequence[Union[str, int]]] = "final",
    batch_size: Optional[PositiveInt] = None,
    progress: bool = True,
) -> LogitLensResult:
    """The answer token's probability and rank when each layer's residual stream is unembedded
    directly (the logit lens, nostalgebraist 2020; see the module docstring for which token is scored).

    Args:
        model: The hooked model.
        prompts: The prompts.
        layers: The layers whose ``resid_post`` is read (default: all).
        positions: One position spec or several, as :func:`~arithinterp.activations.collect` takes them
            (``"final"``, ``"b"``, ``"answer[0]"``, ``"all"``).
        batch_size: Prompts per forward (default: :func:`~arithinterp.activations.collect`'s choice).
        progress: Show a progress bar.

    Returns:
        Probability and rank ``[prompt, layer, position]``; ``to_frame()`` summarises them per layer
        and position.

    Raises:
        SiteError: An empty prompt set, a layer or position the model or prompts lack, or a model
            without blocks and an unembedding to read through.
        ModelMismatchError: The prompts were built for another model.
    """
    check_belongs(model, "logit_lens", prompts=prompts)
    if len(prompts) == 0:
        raise SiteError("the prompt set is empty; nothing to read")
    chosen = site_lib.check_layers(model, "resid_post", layers)
    labels, columns = prompts.locate(positions, answers=prompts.answer_tokens.shape[1])  # checked before any work
    try:
        unembed = Stepper(model).unembed  # the final norm, the unembedding and any soft-cap, as the model ends
    except AnalysisError as error:
        raise SiteError(f"the logit lens needs the model's blocks and unembedding: {error}") from None
    weights = next(model.parameters())
    targets = _answer_tokens(prompts, columns)
    probability = torch.full((len(prompts), len(chosen), len(labels)), math.nan)
    rank = torch.full_like(probability, math.nan)
    # prompts read at once (every layer's residual stream), and unembedded at once (the whole vocabulary)
    per_read = max(1, FLOATS_PER_STEP // (len(chosen) * len(labels) * int(model.cfg.d_model)))
    per_unembed = max(1, FLOATS_PER_STEP // (len(labels) * int(model.cfg.d_vocab)))
    with torch.inference_mode():
        for rows in progress_bar(torch.arange(len(prompts)).split(per_read), desc="logit lens", disable=not progress):
            resid = collect(model, prompts[rows], "resid_post", layers=chosen, positions=labels, batch_size=batch_size,
                            progress=False)["resid_post"]  # [n, layer, position, d]
            for part in torch.arange(len(rows)).split(per_unembed):
                want = targets[rows[part]]  # [n, position]
                scored = want >= 0
                for li in range(len(chosen)):
                    logits = unembed(resid[part, li].to(weights.device, weights.dtype)).float().cpu()  # [n, pos, V]
                    picked = logits.gather(-1, want.clamp(min=0)[..., None])[..., 0]
                    probability[rows[part], li] = torch.where(scored, (picked - logits.logsumexp(-1)).exp(), math.nan)
                    rank[rows[part], li] = torch.where(scored, (logits > picked[..., None]).sum(-1).float(), math.nan)
    fed = prompts.tokens[0].tolist() + prompts.answer_tokens[0].clamp(min=0).tolist()
    tokens = prompts.tokenizer.convert_ids_to_tokens([fed[int(c)] for c in columns[0]])
    meta = build_meta(model, n_prompts=len(prompts), batch_size=batch_size, task=getattr(prompts, "template", None))
    return LogitLensResult(probability=probability, rank=rank, answer_tokens=targets, layers=chosen,
                           positions=list(labels), tokens=list(tokens), meta=meta)
