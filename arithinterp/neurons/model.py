"""Classifying a model's important neurons into heuristics: importance, then maps, then scoring.

:func:`classify` runs :func:`~arithinterp.neurons.importance` on counterfactual pairs, reads the
top neurons' K and KV maps over the operand grid chunk by chunk (:class:`~arithinterp.neurons.neuron_maps.MapRows`)
and scores them (:func:`~arithinterp.neurons.scoring.classify_stream`) → :class:`HeuristicTable`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Optional, Sequence

import torch

from arithinterp.checks import check_belongs
from arithinterp.engine.budget import memory_budget
from arithinterp.errors import ConfigError
from arithinterp.neurons.final_reads import check_model_layers, check_prompts
from arithinterp.neurons.neuron_importance import NeuronImportance, importance
from arithinterp.neurons.neuron_maps import MapRows
from arithinterp.neurons.scoring import check_threshold, classify_stream
from arithinterp.neurons.table import HeuristicTable
from arithinterp.results import build_meta
from arithinterp.types import ByteSize, HookedModel, PositiveInt, checked

if TYPE_CHECKING:
    from arithinterp.tasks import PromptPairs, PromptSet


@checked
def classify(
    model: HookedModel,
    prompts: PromptSet,
    *,
    layers: Optional[Iterable[int]] = None,
    top_k: Optional[PositiveInt] = 200,
    threshold: float = 0.6,
    importance_scores: Optional[NeuronImportance] = None,
    pairs: Optional[PromptPairs] = None,
    method: str = "attribution",
    vary: str = "a",
    bottom: Optional[bool] = None,
    families: Optional[Sequence[str]] = None,
    min_cells: PositiveInt = 3,
    max_fraction: float = 0.5,
    fdr: Optional[float] = 0.05,
    shuffle_control: bool = True,
    registry: Any = None,
    seed: int = 0,
    batch_size: Optional[PositiveInt] = None,
    max_memory: Optional[ByteSize] = None,
    progress: bool = True,
) -> HeuristicTable:
    """Classify a model's important MLP neurons into heuristics (Nikankin et al. 2025).

    Runs :func:`importance` (unless ``top_k`` is None — all neurons — or ``importance_scores``
    is given) on ``pairs`` (default ``prompts.counterfactual(vary, seed, distinct_first_token=True)``: pairs
    whose answers share their first token would score 0), then the maps and
    :func:`classify_maps`'s scoring (``fdr``, ``shuffle_control`` and ``registry`` are passed on:
    a label needs the 0.6 threshold and the cell-shuffle test at that false-discovery rate).
    ``bottom`` defaults to ``model.cfg.gated_mlp``.

    Memory: the neurons are streamed in chunks (a multiple of 128 neurons, layer after layer):
    each chunk's maps are read from reads-only forwards over ``prompts`` and scored, and only the
    table's ``[neurons, heuristics]`` scores are kept, so no ``[prompts, layers, d_mlp]`` grid or
    ``[neurons, vocabulary]`` product exists. Chunks and forward batches are sized from
    ``max_memory`` (bytes on top of the model and the table;
    :func:`arithinterp.engine.budget.memory_budget` by default); ``batch_size`` fixes the prompts
    per forward instead. The table is the same whatever the chunking.

    Args:
        model: The hooked model.
        prompts: A PromptSet covering the operand grid.
        layers: The layers classified (default all).
        top_k: Neurons per layer by importance (``None``: every neuron).
        threshold: The score a label needs.
        importance_scores: Importance already computed (skips :func:`importance`).
        pairs: The counterfactual pairs importance is computed on.
        method: The importance method.
        vary: What the default pairs vary.
        bottom: Also score the bottom of each map (default ``model.cfg.gated_mlp``).
        families: The heuristic families scored (default all).
        min_cells: The fewest grid cells a heuristic covers.
        max_fraction: The largest share of the grid a heuristic covers.
        fdr: The false-discovery rate of the cell-shuffle test (``None``: no test).
        shuffle_control: Run the cell-shuffle control.
        registry: A :class:`~arithinterp.neurons.HeuristicRegistry` of heuristics.
        seed: The seed of the pairs and the shuffles.
        batch_size: Prompts per forward (default: from ``max_memory``).
        max_memory: Bytes on top of the model and the table.
        progress: Show progress bars.

    Returns:
        The neurons' classification (a :class:`HeuristicTable`).

    Raises:
        ConfigError: ``importance_scores`` misses a layer, or an argument is refused.
    """
    check_belongs(model, "neurons.classify", prompts=prompts, pairs=pairs, importance_scores=importance_scores)
    check_prompts(prompts)
    threshold = check_threshold(threshold)
    budget = memory_budget(model, max_memory)
    chosen = check_model_layers(model, layers)
    if importance_scores is None and top_k is not None:
        # partners whose answer starts with another token: a pair sharing the first answer token has a
        # first-token logit difference of 0 and would rank nothing (a third of 2-digit sums share a tens digit)
        pairs = pairs if pairs is not None else prompts.counterfactual(vary=vary, seed=seed, distinct_first_token=True)
        importance_scores = importance(model, pairs, method=method, layers=chosen, top_k=top_k, batch_size=batch_size,
                                       max_memory=budget, progress=progress)
    if importance_scores is not None:
        missing = [l for l in chosen if l not in importance_scores.layers]
        if missing:
            raise ConfigError(
                f"importance_scores has no scores for layers {missing}; it covers {importance_scores.layers}")
        rows = [importance_scores.layers.index(l) for l in chosen]
        top = importance_scores.top[rows]
        layer = torch.tensor(chosen).repeat_interleave(top.shape[1])
        neuron = top.flatten()
        imp = importance_scores.scores[rows].gather(1, top).flatten()
    else:
        d_mlp = int(model.cfg.d_mlp)
        layer = torch.tensor(chosen).repeat_interleave(d_mlp)
        neuron = torch.arange(d_mlp).repeat(len(chosen))
        imp = None
    # a quarter of the budget for the forwards' batches, half for the activations of the neurons
    # whose maps are read in one pass, a quarter for the maps and scores of one chunk of neurons
    source = MapRows(model, prompts, layer, neuron, batch_size, budget, progress, forward_share=0.25,
                      buffer_share=0.5)
    if bottom is None:
        bottom = bool(getattr(model.cfg, "gated_mlp", False))
    missing_cells = int((~source.present).sum())
    return classify_stream(
        source, len(layer), source.a_values, source.b_values, prompts.op, threshold, legal=source.present,
        max_memory=budget, memory_share=0.25,
        modulus=prompts.modulus, families=families, bottom=bottom, min_cells=min_cells, max_fraction=max_fraction,
        layers=layer, neurons=neuron, importance=imp, seed=seed, progress=progress,
        fdr=fdr, shuffle_control=shuffle_control, registry=registry,
        meta=build_meta(model, n_prompts=len(prompts), top_k=top_k, method=method if imp is not None else None,
                        missing_cells=missing_cells, max_memory=budget),
    )
