"""Feature circuits: transcoders, the replacement model, and what their features carry.

Follows Ameisen et al. 2025, "Circuit Tracing", on models the user trained:

* ``transcoder`` — :class:`Transcoders`, one TopK transcoder per layer (MLP input → MLP output,
  with a linear skip), and the engine interventions that swap MLPs for them.
* ``training`` — :func:`train_transcoders`: activations read through the engine, fitted, measured
  on held-out prompts (FVU, L0, dead features).
* ``replacement`` — the replacement model (every MLP replaced, no error term): top-1 agreement and KL
  (:func:`replacement_metrics` → :class:`ReplacementResult`).
* ``graph`` — :func:`attribution_graph`: the :class:`AttributionGraph` of one prompt over the local
  replacement model (``graph.prompt_graph`` takes a text or token ids instead of a prompt set).
* ``interventions`` — :func:`intervene`: clamp, scale or zero features in the real model, read the
  answers (:class:`FeatureInterventionResult`).
* ``labels`` — :func:`label_features`: the neurons' calibrated heuristic classifier on feature maps,
  plus a lookup-table family ("a ≡ i and b ≡ j (mod 10)"); :func:`feature_grids` draws features
  over the operand grid (:func:`graph_feature_grids`: a graph's kept features, for its viewer).
* ``paths`` — :func:`feature_paths` sorts labelled features into a last-digit and a magnitude path;
  :func:`path_ablation` zeroes one and measures the answer logit left, beside a random control.
* ``sample`` — :func:`graph_sample`: graphs over a sample of prompts, aggregated per feature.
* ``shipped`` — transcoders trained for the zoo models, shipped in the package, and their recipe.
* ``transcoder_files`` — transcoders and SAEs in circuit-tracer's and SAELens's layouts, read onto a
  model (hook points mapped, checked by FVU on the model's prompts) and written.
* ``graph_files`` — graphs as circuit-tracer's viewer JSON (pruned as it prunes);
  ``graph_reader`` — graphs read from its ``.pt``.
"""

from arithinterp.features.graph import AttributionGraph, attribution_graph
from arithinterp.features.graph_files import write_circuit_tracer_graph
from arithinterp.features.graph_reader import read_circuit_tracer_graph
from arithinterp.features.interventions import FeatureInterventionResult, feature_interventions, intervene
from arithinterp.features.labels import (
    FeatureGridsResult, feature_grids, feature_maps, graph_feature_grids, label_features, lookup_registry,
)
from arithinterp.features.paths import PathAblationResult, feature_paths, path_ablation, path_of
from arithinterp.features.replacement import ReplacementResult, replacement_metrics
from arithinterp.features.sample import GraphSample, graph_sample
from arithinterp.features.training import train_transcoders
from arithinterp.features.shipped import load_transcoders
from arithinterp.features.transcoder import Transcoders, topk_activations
from arithinterp.features.transcoder_files import (
    read_circuit_tracer_transcoders,
    read_saelens,
    transcoder_fvu,
    write_circuit_tracer_transcoders,
    write_saelens,
)

__all__ = [
    "AttributionGraph", "FeatureGridsResult", "FeatureInterventionResult", "GraphSample", "PathAblationResult",
    "ReplacementResult", "Transcoders", "attribution_graph", "feature_grids", "feature_interventions", "feature_maps",
    "feature_paths", "graph_feature_grids", "graph_sample", "intervene", "label_features", "load_transcoders",
    "lookup_registry", "path_ablation", "path_of", "read_circuit_tracer_graph", "read_circuit_tracer_transcoders",
    "read_saelens", "replacement_metrics", "topk_activations", "train_transcoders", "transcoder_fvu",
    "write_circuit_tracer_graph", "write_circuit_tracer_transcoders", "write_saelens",
]
