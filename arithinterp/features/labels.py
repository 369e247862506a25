"""Arithmetic labels for transcoder features, by the neurons' calibrated heuristic classifier.

A feature's **K map** is its activation at the final position over the operand grid; its **KV
map** that activation times its decoder row's direct logit-lens value for the true answer token
(``(W_dec[f] @ W_U)[answer]``, the final norm left out, as for neurons). Both go to
:func:`arithinterp.neurons.classify_maps` (score threshold plus the cell-shuffle test at a false
discovery rate, Nikankin et al. 2025), with the built-in families and a **lookup-table** family
("a ≡ i and b ≡ j (mod 10)", the case study's "ends in 6" + "ends in 9" features).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import pandas as pd
import torch

from arithinterp.checks import check_belongs
from arithinterp.drawing import draw
from arithinterp.errors import AnalysisError, ConfigError
from arithinterp.features.training import mlp_activations
from arithinterp.features.transcoder import Transcoders
from arithinterp.neurons import Grid, Heuristic, HeuristicRegistry, HeuristicTable, classify_maps
from arithinterp.results import NON_NEGATIVE, Result, build_meta
from arithinterp.tasks import PromptSet
from arithinterp.types import HookedModel, IndexList, NonNegativeInt, checked

LOOKUP_FAMILY = "operand lookup table"


def _lookup_table(grid: Grid) -> list[Heuristic]:
    return [Heuristic(f"a mod 10 = {i} and b mod 10 = {j}", LOOKUP_FAMILY, "K",
                      lambda a, b, i=i, j=j: (a % 10 == i) & (b % 10 == j)) for i in range(10) for j in range(10)]


@checked
def lookup_registry() -> HeuristicRegistry:
    """The built-in heuristic families plus the lookup-table family.

    Returns:
        A new registry.
    """
    registry = HeuristicRegistry()
    registry.add_family(LOOKUP_FAMILY, "K", _lookup_table)
    return registry


@checked
def feature_maps(model: HookedModel, prompts: PromptSet, transcoders: Transcoders, layer: NonNegativeInt,
                 features: Optional[IndexList] = None, *,
                 positions: int = -1) -> tuple[torch.Tensor, torch.Tensor, list, list]:
    """K and KV maps of transcoder features over a full operand grid.

    Args:
        model: The hooked model.
        prompts: A full operand grid of single-answer-token, equal-length prompts.
        transcoders: The transcoders.
        layer: The layer.
        features: The features' indices (None: all).
        positions: The one position read (default the final one).

    Returns:
        ``(k_maps, kv_maps, a_values, b_values)``: the maps Float[Tensor, "feature a b"]
        (activation, and activation × the feature's logit-lens value of the answer) and the grid's
        operand values.

    Raises:
        AnalysisError: Prompts that are not a full grid, multi-token answers, prompts of several
            lengths, or a position outside them.
        ModelMismatchError: Prompts or transcoders made for another model.
    """
    check_belongs(model, "feature_maps", prompts=prompts)
    transcoders.check_model(model)
    transcoders.index(layer)
    a_values, b_values = sorted(set(prompts.a.tolist())), sorted(set(prompts.b.tolist()))
    if len(prompts) != len(a_values) * len(b_values):
        raise AnalysisError(f"prompts must be a full operand grid: {len(prompts)} prompts for "
                            f"{len(a_values)} × {len(b_values)} operand values")
    if bool((prompts.n_answer_tokens != 1).any()):
        raise AnalysisError("feature maps need single-token answers (the KV map reads one answer logit)")
    if not prompts.uniform_length:
        raise AnalysisError("feature maps read one position of every prompt: pass prompts of one length")
    T = int(prompts.tokens.shape[1])
    if not -T <= positions < T:
        raise ConfigError(f"positions must be one int in {-T}..{T - 1} for prompts of {T} tokens, got {positions!r}")
    chosen = list(range(transcoders.n_features)) if features is None else transcoders.features_of(features)
    ins, _ = mlp_activations(model, prompts.tokens, [layer])
    acts = transcoders.encode(layer, ins[0][:, positions])[:, chosen]  # [N, n]
    W_U = model.W_U.detach().float()
    lens = (transcoders.W_dec[transcoders.index(layer), chosen] @ W_U)[:, prompts.answer_tokens[:, 0]]  # [n, N]
    ia = torch.tensor([a_values.index(v) for v in prompts.a.tolist()])
    ib = torch.tensor([b_values.index(v) for v in prompts.b.tolist()])
    k_maps = torch.full((len(chosen), len(a_values), len(b_values)), float("nan"))
    k_maps[:, ia, ib] = acts.T
    kv_maps = torch.full_like(k_maps, float("nan"))
    kv_maps[:, ia, ib] = acts.T * lens
    return k_maps, kv_maps, a_values, b_values


@checked
def label_features(model: HookedModel, prompts: PromptSet, transcoders: Transcoders, layer: NonNegativeInt,
                   features: Optional[IndexList] = None, *, positions: int = -1, **classify: Any) -> HeuristicTable:
    """A :class:`~arithinterp.neurons.HeuristicTable` over ``features`` of ``layer`` at ``positions``
    (its ``neurons`` are feature indices), labelled with the built-in families plus the lookup-table
    family.

    Args:
        model: The hooked model.
        prompts: A full operand grid, as for :func:`feature_maps`.
        transcoders: The transcoders.
        layer: The layer.
        features: The features' indices (None: all).
        positions: The one position read (default the final one).
        **classify: Options of :func:`~arithinterp.neurons.classify_maps`.

    Returns:
        The labelled table.
    """
    chosen = list(range(transcoders.n_features)) if features is None else transcoders.features_of(features)
    k_maps, kv_maps, a_values, b_values = feature_maps(model, prompts, transcoders, layer, chosen, positions=positions)
    return classify_maps(k_maps, kv_maps, a_values, b_values, prompts.op, registry=lookup_registry(),
                         layers=torch.full((len(chosen),), layer), neurons=torch.tensor(chosen), **classify)


@dataclasses.dataclass(frozen=True)
class FeatureGridsResult(Result):
    """Transcoder features' activations over the operand grid: the "Biology" case study's operand plots.

    Attributes:
        layer: The layer.
        features: The features' indices.
        labels: A name per feature, for the panels' titles.
        a_values: The grid's rows.
        b_values: The grid's columns.
        maps (Float[Tensor, "feature a b"]): The activations.
        meta: Provenance and the position read.
    """

    layer: int
    features: list
    labels: list
    a_values: list
    b_values: list
    maps: torch.Tensor
    meta: dict

    # what load checks: the axes fields share and the values they may take
    _shapes = {"features": "feature", "labels": "feature", "a_values": "a", "b_values": "b", "maps": "feature a b"}
    _legal = {"layer": NON_NEGATIVE, "features": NON_NEGATIVE}

    def to_frame(self) -> pd.DataFrame:
        """One row per feature and operand pair: its activation."""
        n, n_a, n_b = self.maps.shape
        return pd.DataFrame(dict(
            layer=self.layer,
            feature=[f for f in self.features for _ in range(n_a * n_b)],
            label=[label for label in self.labels for _ in range(n_a * n_b)],
            a=[a for _ in range(n) for a in self.a_values for _ in range(n_b)],
            b=[b for _ in range(n * n_a) for b in self.b_values],
            activation=self.maps.flatten().tolist()))

    def plot(self, **kwargs: Any):
        return draw(self, **kwargs)


@checked
def feature_grids(model: HookedModel, prompts: PromptSet, transcoders: Transcoders, layer: NonNegativeInt,
                  features: IndexList, *, positions: int = -1,
                  labels: Optional[Sequence[str]] = None) -> FeatureGridsResult:
    """``features`` of ``layer`` at ``positions`` over a full grid of prompts (as :func:`feature_maps`);
    ``.plot()`` draws one operand-grid heatmap per feature.

    Args:
        model: The hooked model.
        prompts: A full operand grid.
        transcoders: The transcoders.
        layer: The layer.
        features: The features' indices.
        positions: The one position read (default the final one).
        labels: One per feature, in the panels' titles.

    Returns:
        The grids.

    Raises:
        AnalysisError: A label count unlike the feature count, or prompts :func:`feature_maps` refuses.
    """
    chosen = transcoders.features_of(features)
    if labels is not None and len(labels) != len(chosen):
        raise ConfigError(f"one label per feature: got {len(labels)} labels for {len(chosen)} features")
    k_maps, _, a_values, b_values = feature_maps(model, prompts, transcoders, layer, chosen, positions=positions)
    return FeatureGridsResult(layer=int(layer), features=chosen, labels=[str(x) for x in labels or [""] * len(chosen)],
                              a_values=[int(a) for a in a_values], b_values=[int(b) for b in b_values],
                              maps=torch.as_tensor(k_maps, dtype=torch.float32),
                              meta=build_meta(model, position=int(positions)))
