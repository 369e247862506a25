"""Feature interventions on the real model: clamp, scale or zero transcoder features, read the logits.

The MLP's true output is kept and only the chosen features' change is added to it,
``mlp_out + (acts' − acts) @ W_dec``, so with no change the run is the model's own (the
transcoder's error stays in place, as in the interventions of Lindsey et al. 2025). Everything
runs through the engine: the MLP input is seen by an identity intervention, the output changed by
a second one.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from arithinterp.engine import Intervention, run
from arithinterp.checks import check_tokens
from arithinterp.errors import ConfigError, SiteError
from arithinterp.features.transcoder import Transcoders
from arithinterp.types import IndexList, IntList, NonNegativeInt, checked


@checked
def feature_interventions(transcoders: Transcoders, layer: NonNegativeInt, features: IndexList, *,
                          scale: float = 0.0, clamp: Optional[float] = None,
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
        The interventions to run together, two :class:`~arithinterp.engine.Intervention` s: one
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

    return [Intervention("mlp_in", layer, value=look), Intervention("mlp_out", layer, value=change)]


@checked
def intervene(model: Any, tokens: torch.Tensor, transcoders: Transcoders, layer: NonNegativeInt,
              features: IndexList, *, scale: float = 0.0, clamp: Optional[float] = None,
              positions: Optional[IntList] = None) -> torch.Tensor:
    """The final-position logits with some features changed, as :func:`feature_interventions` says.

    Args:
        model: The hooked model.
        tokens (Int[Tensor, "batch pos"]): The prompts.
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
