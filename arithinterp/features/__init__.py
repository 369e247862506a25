"""Feature circuits: transcoders, the replacement model, and what their features carry.

Follows Ameisen et al. 2025, "Circuit Tracing", on models the user trained:

* ``transcoder`` — :class:`Transcoders`, one TopK transcoder per layer (MLP input → MLP output,
  with or without a linear skip), and the engine interventions that swap MLPs for them.
* ``rows`` / ``training`` — :func:`train_transcoders`: every layer's MLP inputs and outputs read
  layer by layer (in sequence: each layer on the inputs of the model whose earlier MLPs are
  replaced), fitted, optionally fine-tuned end to end, measured on held-out prompts.
* ``plan`` / ``cache`` — :func:`plan_transcoders` (the task, the held-out split and the settings,
  from the model's shape and the task) and :func:`train_planned` (``arithinterp train-transcoders``),
  cached per model fingerprint where :func:`find_transcoders` finds them.
* ``replacement`` — the replacement model (every MLP replaced, no error term): top-1 agreement and KL
  (:func:`replacement_metrics` → :class:`ReplacementResult`).
* ``graph`` — :func:`attribution_graph`: the :class:`AttributionGraph` of one prompt over the local
  replacement model (``graph.prompt_graph`` takes a text or token ids instead of a prompt set).
* ``interventions`` — :func:`intervene`: clamp, scale or zero features in the real model, read the
  answers (:class:`FeatureInterventionResult`).
* ``labels`` — :func:`label_features`: the neurons' calibrated heuristic classifier on feature maps,
  plus a lookup-table family ("a ≡ i and b ≡ j (mod 10)"); :func:`feature_grids` draws features
  over the operand grid.
* ``operand_plots`` — :func:`operand_plots`: every feature's activity over an ``a × b`` grid at each
  position role (sparse), :func:`label_plots` labels from them, :func:`graph_feature_grids` a
  graph's kept features' plots for its viewer.
* ``supernodes`` — :func:`label_graph` and :func:`supernodes`: a graph's features grouped by label
  and attribution profile.
* ``steering`` — :func:`swap_test`: labelled supernodes swapped on held-out problems, beside
  random-feature controls (:class:`SwapResult`).
* ``paths`` — :func:`feature_paths` sorts labelled features into a last-digit and a magnitude path;
  :func:`path_ablation` zeroes one and measures the answer logit left, beside a random control.
* ``sample`` — :func:`graph_sample`: graphs over a sample of prompts, aggregated per feature.
* ``shipped`` — the transcoders shipped for the zoo models (data with their cards).
* ``transcoder_files`` — transcoders and SAEs in circuit-tracer's and SAELens's layouts, read onto a
  model (hook points mapped, checked by FVU on the model's prompts) and written.
* ``graph_files`` — graphs as circuit-tracer's viewer JSON (pruned as it prunes);
  ``graph_reader`` — graphs read from its ``.pt``.
"""

from arithinterp.features.cache import cache_folder, find_transcoders
from arithinterp.features.graph import AttributionGraph, attribution_graph
from arithinterp.features.graph_files import write_circuit_tracer_graph
from arithinterp.features.graph_reader import read_circuit_tracer_graph
from arithinterp.features.interventions import FeatureInterventionResult, feature_interventions, intervene
from arithinterp.features.labels import (
    FeatureGridsResult, feature_grids, feature_maps, label_features, lookup_registry,
)
from arithinterp.features.operand_plots import OperandPlots, graph_feature_grids, label_plots, operand_plots
from arithinterp.features.paths import PathAblationResult, feature_paths, path_ablation, path_of
from arithinterp.features.plan import TranscoderPlan, plan_transcoders, train_planned
from arithinterp.features.replacement import ReplacementResult, replacement_metrics
from arithinterp.features.sample import GraphSample, graph_sample
from arithinterp.features.training import train_transcoders
from arithinterp.features.shipped import load_transcoders
from arithinterp.features.steering import SwapResult, swap_test
from arithinterp.features.supernodes import Supernode, label_graph, labelled_share, supernodes
from arithinterp.features.transcoder import Transcoders, topk_activations
from arithinterp.features.transcoder_files import (
    read_circuit_tracer_transcoders,
    read_saelens,
    transcoder_fvu,
    write_circuit_tracer_transcoders,
    write_saelens,
)

__all__ = [
    "AttributionGraph", "FeatureGridsResult", "FeatureInterventionResult", "GraphSample", "OperandPlots",
    "PathAblationResult", "ReplacementResult", "Supernode", "SwapResult", "TranscoderPlan", "Transcoders",
    "attribution_graph", "cache_folder", "feature_grids", "feature_interventions", "feature_maps", "feature_paths",
    "find_transcoders", "graph_feature_grids", "graph_sample", "intervene", "label_features", "label_graph",
    "label_plots", "labelled_share", "load_transcoders", "lookup_registry", "operand_plots", "path_ablation",
    "path_of", "plan_transcoders", "read_circuit_tracer_graph", "read_circuit_tracer_transcoders", "read_saelens",
    "replacement_metrics", "supernodes", "swap_test", "topk_activations", "train_planned", "train_transcoders",
    "transcoder_fvu", "write_circuit_tracer_graph", "write_circuit_tracer_transcoders", "write_saelens",
]
