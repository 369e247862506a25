"""Feature interventions on the real model: clamp, scale or zero transcoder features, read the answers.

The MLP's true output is kept and only the chosen features' change is added to it,
``mlp_out + (acts' − acts) @ W_dec``, so with no change the run is the model's own (the
transcoder's error stays in place, as in the interventions of Lindsey et al. 2025). Everything
runs through the engine: the MLP input is seen by an identity intervention, the output changed by
a second one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from arithinterp.checks import check_belongs, check_tokens
from arithinterp.drawing import draw
from arithinterp.engine import Write, run
from arithinterp.errors import ConfigError, SiteError
from arithinterp.features.transcoder import Transcoders
from arithinterp.results import NON_NEGATIVE, PROBABILITY, Result, build_meta
from arithinterp.tasks import PromptSet
from arithinterp.types import Float32, HookedModel, IndexList, IntList, NonNegativeInt, checked

if TYPE_CHECKING:
    import pandas as pd
    import plotly.graph_objects as go


@checked
def feature_interventions(transcoders: Transcoders, layer: NonNegativeInt, features: IndexList, *,
                          scale: Float32 = 0.0, clamp: Optional[Float32] = None,
                          positions: Optional[IntList] = None) -> list:
    """Engine interventions that change some transcoder features of one layer: the MLP output moves
    by the change of their decoded contribution.

    Args:
        transcoders: The transcoders.
        layer: The layer.
        features: The features' indices.
        scale: Set the features to ``scale ×`` their activation (0: zero them).
        clamp: Set them to this value instead.
        positions: The positions to change (None: every position; each must lie inside the prompts
            the interventions are run on, as :func:`intervene` checks).

    Returns:
        The interventions to run together, two :class:`~arithinterp.engine.Write` s: one
        reading ``mlp_in``, one changing ``mlp_out``.

    Raises:
        SiteError: A layer without a transcoder.
        ConfigError: An empty ``positions``, or features that are empty, unknown or repeated.
    """
    transcoders.index(layer)
    chosen = transcoders.features_of(features)
    if positions is not None and not len(positions):
        raise ConfigError("positions is empty; give None for every position, or the positions to change")
    seen: dict[str, torch.Tensor] = {}

    def look(x: torch.Tensor) -> torch.Tensor:
        seen["x"] = x
        return x

    def change(out: torch.Tensor) -> torch.Tensor:
        x = seen["x"]
        acts = transcoders.encode(layer, x)
        # a mask, not fancy indexing: positions and features as two index lists would pair up elementwise
        mask = torch.zeros(acts.shape[1:], dtype=torch.bool, device=acts.device)  # [T, F]
        rows = torch.arange(acts.shape[1]) if positions is None else torch.as_tensor(list(positions))
        mask[rows[:, None], torch.tensor(chosen)[None, :]] = True
        target = torch.full_like(acts, clamp) if clamp is not None else acts * scale
        edited = torch.where(mask, target, acts)
        delta = (edited - acts) @ transcoders.W_dec[transcoders.index(layer)]
        return out + delta.to(out.dtype)

    return [Write("mlp_in", layer, value=look), Write("mlp_out", layer, value=change)]


@dataclass(frozen=True)
class FeatureInterventionResult(Result):
    """Each prompt's answer with some transcoder features changed (:func:`intervene`), beside the
    model's own.

    Attributes:
        prob_before: ``[prompt]`` the probability of the answer's first token, nothing changed.
        prob_after: ``[prompt]`` the same with the features changed.
        logprob_before: ``[prompt]`` its log-probability, nothing changed.
        logprob_after: ``[prompt]`` with the features changed.
        top_before: ``[prompt]`` the most likely token, nothing changed.
        top_after: ``[prompt]`` with the features changed.
        answer: ``[prompt]`` the answer's first token.
        layer: The transcoder layer changed.
        features: The features changed.
        scale: Their activations times this (0: zeroed), unless ``clamp``.
        clamp: The value they were set to instead (None: scaled).
        positions: The positions changed (None: every position), counted in each prompt.
        meta: Provenance.
    """

    prob_before: torch.Tensor
    prob_after: torch.Tensor
    logprob_before: torch.Tensor
    logprob_after: torch.Tensor
    top_before: torch.Tensor
    top_after: torch.Tensor
    answer: torch.Tensor
    layer: int
    features: list
    scale: float
    clamp: Optional[float]
    positions: Optional[list]
    meta: dict

    # what load checks: the axes fields share and the values they may take
    _shapes = {"prob_before": "prompt", "prob_after": "prompt", "logprob_before": "prompt", "logprob_after": "prompt",
               "top_before": "prompt", "top_after": "prompt", "answer": "prompt"}
    _legal = {"prob_before": PROBABILITY, "prob_after": PROBABILITY, "layer": NON_NEGATIVE, "features": NON_NEGATIVE,
              "top_before": NON_NEGATIVE, "top_after": NON_NEGATIVE, "answer": NON_NEGATIVE}

    @property
    def accuracy_before(self) -> float:
        """The share of prompts whose most likely token is the answer's, nothing changed."""
        return float((self.top_before == self.answer).float().mean())

    @property
    def accuracy_after(self) -> float:
        """The same with the features changed."""
        return float((self.top_after == self.answer).float().mean())

    def to_frame(self) -> pd.DataFrame:
        """One row per prompt: the answer's probability and log-probability before and after, and
        whether the most likely token is the answer's."""
        import pandas as pd

        return pd.DataFrame(dict(prompt=list(range(len(self.answer))), prob_before=self.prob_before.tolist(),
                                 prob_after=self.prob_after.tolist(), logprob_before=self.logprob_before.tolist(),
                                 logprob_after=self.logprob_after.tolist(),
                                 correct_before=(self.top_before == self.answer).tolist(),
                                 correct_after=(self.top_after == self.answer).tolist()))

    def plot(self, **kwargs: Any) -> go.Figure:
        """The answer's probability per prompt, before against after (see viz.features)."""
        return draw(self, **kwargs)


@checked
def intervened_logits(model: HookedModel, tokens: torch.Tensor, transcoders: Transcoders, layer: NonNegativeInt,
                      features: IndexList, *, scale: Float32 = 0.0, clamp: Optional[Float32] = None,
                      positions: Optional[IntList] = None) -> torch.Tensor:
    """The final-position logits of token ids with some features changed, as
    :func:`feature_interventions` says: the tensor path under :func:`intervene`.

    Args:
        model: The hooked model.
        tokens (Int[Tensor, "batch pos"]): The prompts, of one length.
        transcoders: The transcoders.
        layer: The layer.
        features: The features' indices.
        scale: As for :func:`feature_interventions`.
        clamp: As for :func:`feature_interventions`.
        positions: The positions to change, in ``-pos..pos-1`` (None: every position).

    Returns:
        Float[Tensor, "batch vocab"]: The logits.

    Raises:
        SiteError: Positions outside the prompts.
        ModelMismatchError: Transcoders made for another model.
    """
    transcoders.check_model(model)
    check_tokens(model, tokens)
    T = int(tokens.shape[1])
    if positions is not None and any(not -T <= int(p) < T for p in positions):
        raise SiteError(f"positions {list(positions)} are not all positions of prompts of {T} tokens "
                        f"(accepted: {-T}..{T - 1})")
    interventions = feature_interventions(transcoders, layer, features, scale=scale, clamp=clamp, positions=positions)
    logits = run(model, tokens, interventions).logits
    assert logits is not None
    return logits


@checked
def intervene(model: HookedModel, prompts: PromptSet, transcoders: Transcoders, layer: NonNegativeInt,
              features: IndexList, *, scale: Float32 = 0.0, clamp: Optional[Float32] = None,
              positions: Optional[IntList] = None) -> FeatureInterventionResult:
    """Each prompt's answer with some features changed, as :func:`feature_interventions` says,
    beside the model's own (the first answer token, read at the final position).

    Args:
        model: The hooked model.
        prompts: The prompts (of any lengths: each length runs unpadded).
        transcoders: The transcoders.
        layer: The layer.
        features: The features' indices.
        scale: As for :func:`feature_interventions`.
        clamp: As for :func:`feature_interventions`.
        positions: The positions to change, counted in each prompt from its first token (negative:
            from its end; ``[-1]`` is the final position); None: every position.

    Returns:
        The answer's probability, log-probability and the most likely token per prompt, before
        and after, as a :class:`FeatureInterventionResult`.

    Raises:
        SiteError: Positions outside a prompt.
        ConfigError: No prompts.
        ModelMismatchError: Prompts or transcoders made for another model.
    """
    check_belongs(model, "features.intervene", prompts=prompts)
    transcoders.check_model(model)
    if len(prompts) == 0:
        raise ConfigError("prompts is empty; give at least one prompt")
    n = len(prompts)
    before, after = torch.empty(n, 2), torch.empty(n, 2)
    tops = torch.empty(n, 2, dtype=torch.long)
    answer = prompts.answer_tokens[:, 0]
    for group in prompts.length_groups():
        tokens = prompts.unpadded(group)
        plain = run(model, tokens).logits
        assert plain is not None
        changed = intervened_logits(model, tokens, transcoders, layer, features, scale=scale, clamp=clamp,
                                    positions=positions)
        for column, logits in enumerate((plain, changed)):
            logprobs = logits.float().log_softmax(-1)
            picked = logprobs.gather(1, answer[group, None].to(logprobs.device))[:, 0].cpu()
            (before if column == 0 else after)[group] = torch.stack([picked.exp(), picked], 1)
            tops[group, column] = logits.argmax(-1).cpu()
    return FeatureInterventionResult(
        prob_before=before[:, 0], prob_after=after[:, 0], logprob_before=before[:, 1], logprob_after=after[:, 1],
        top_before=tops[:, 0], top_after=tops[:, 1], answer=answer.clone(), layer=int(layer),
        features=[int(f) for f in features], scale=float(scale), clamp=None if clamp is None else float(clamp),
        positions=None if positions is None else [int(p) for p in positions],
        meta=build_meta(model, n_prompts=n),
    )
