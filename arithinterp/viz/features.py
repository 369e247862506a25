"""Figures of feature circuits: transcoder quality per layer, attribution graphs, operand grids,
path ablations and graphs over a prompt sample."""

from __future__ import annotations

from typing import Any, Optional

import pandas as pd
import plotly.graph_objects as go

from arithinterp.drawing import draws
from arithinterp.features.graph import AttributionGraph
from arithinterp.features.interventions import FeatureInterventionResult
from arithinterp.features.labels import FeatureGridsResult
from arithinterp.features.paths import PathAblationResult
from arithinterp.features.replacement import ReplacementResult
from arithinterp.features.sample import GraphSample
from arithinterp.features.steering import SwapResult
from arithinterp.features.transcoder import Transcoders
from arithinterp.viz.base import figure


def plot_transcoder_metrics(frame: pd.DataFrame, title: Optional[str] = None) -> go.Figure:
    """Grouped bars per layer of a transcoder table (``Transcoders.to_frame()``): FVU and dead fraction."""
    import plotly.graph_objects as go

    fig = figure(title or "Transcoders: held-out reconstruction per layer", "layer", "fraction (0 = perfect)",
                 barmode="group")
    for column, name in (("fvu", "FVU (fraction of variance unexplained)"), ("dead_fraction", "dead features")):
        fig.add_trace(go.Bar(x=[f"L{layer}" for layer in frame["layer"]], y=frame[column], name=name,
                             hovertemplate="%{x}: %{y:.4f}<extra>" + name + "</extra>"))
    return fig


@draws(Transcoders)
def plot_transcoders(transcoders: Transcoders, title: Optional[str] = None) -> go.Figure:
    """:func:`plot_transcoder_metrics` of ``transcoders.to_frame()``."""
    return plot_transcoder_metrics(transcoders.to_frame(), title=title)


@draws(AttributionGraph)
def plot_attribution_graph(graph: AttributionGraph, kept_only: bool = True, title: Optional[str] = None) -> go.Figure:
    """An attribution graph drawn as positions × layers: nodes sized by influence, edges as lines
    whose width is the edge weight (blue positive, red negative); hover gives each node's kind,
    label, activation and influence."""
    import plotly.graph_objects as go

    nodes: Any = graph.node_frame()  # Any: pandas' stubs cannot follow the column arithmetic below
    keep = nodes["kept"] if kept_only else nodes["kind"].notna()
    shown = nodes[keep]
    # features of one layer and position are spread a little along x so they do not overlap
    offset = shown.groupby(["layer", "position"]).cumcount()
    count = shown.groupby(["layer", "position"])["kind"].transform("size")
    x = shown["position"] + 0.6 * (offset - (count - 1) / 2) / count.clip(lower=1)
    y = shown["layer"].astype(float) + shown["kind"].map({"error": 0.3}).fillna(0.0)
    where = dict(zip(shown.index, zip(x, y)))
    fig = figure(title or f"Attribution graph of {graph.prompt!r}", "position (token)", "layer (-1: embeddings)")
    frame: Any = graph.to_frame(kept_only=kept_only)
    scale = float(frame["weight"].abs().max()) if len(frame) else 1.0
    for row in frame.itertuples():
        if row.source not in where or row.target not in where:
            continue
        (x0, y0), (x1, y1) = where[row.source], where[row.target]
        fig.add_trace(go.Scatter(x=[x0, x1], y=[y0, y1], mode="lines", showlegend=False, hoverinfo="skip",
                                 line=dict(width=0.5 + 4 * abs(row.weight) / scale,
                                           color="rgba(33,102,172,0.5)" if row.weight > 0 else "rgba(178,24,43,0.5)")))
    for kind, symbol in (("embedding", "square"), ("feature", "circle"), ("error", "diamond"), ("logit", "star")):
        part = shown[shown["kind"] == kind]
        if not len(part):
            continue
        text = [f"{k} L{layer} pos {p} ({tok!r}) #{f}<br>{label}<br>activation {a:.4g}, influence {inf:.4g}"
                for k, layer, p, tok, f, label, a, inf in zip(part["kind"], part["layer"], part["position"],
                                                               part["token"], part["feature"], part["label"],
                                                               part["activation"], part["influence"])]
        fig.add_trace(go.Scatter(x=[where[i][0] for i in part.index], y=[where[i][1] for i in part.index],
                                 mode="markers", name=kind, text=text, hovertemplate="%{text}<extra></extra>",
                                 marker=dict(symbol=symbol, size=8 + 30 * part["influence"].clip(lower=0) ** 0.5)))
    fig.update_xaxes(tickvals=list(range(len(graph.tokens))),
                     ticktext=[f"{i}: {t}" for i, t in enumerate(graph.tokens)])
    return fig


@draws(FeatureGridsResult)
def plot_feature_grids(grids: FeatureGridsResult, title: Optional[str] = None) -> go.Figure:
    """Operand-grid heatmaps (rows a, columns b) of features' activations, one panel per feature in a
    row of at most four (the "Biology" case study's operand plots); sequential colour from 0
    (activations are non-negative), hover with the exact value."""
    import math

    import numpy as np
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    from arithinterp.viz.base import SEQUENTIAL_SCALE, TEMPLATE_NAME

    k_maps, a_values, b_values, layer = grids.maps, grids.a_values, grids.b_values, grids.layer
    features, labels = grids.features, grids.labels
    cols = min(4, len(features))
    rows = math.ceil(len(features) / cols)
    names = [f"L{layer} f{f}" + (f": {label}" if label else "") for f, label in zip(features, labels)]
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=names, horizontal_spacing=0.06, vertical_spacing=0.12)
    top = float(np.nanmax(np.asarray(k_maps, dtype=float))) if np.isfinite(np.asarray(k_maps, dtype=float)).any() else 1
    for i, f in enumerate(features):
        row, col = i // cols + 1, i % cols + 1
        fig.add_trace(go.Heatmap(
            z=np.asarray(k_maps[i], dtype=float), x=[str(b) for b in b_values], y=[str(a) for a in a_values],
            colorscale=SEQUENTIAL_SCALE, zmin=0.0, zmax=max(top, 1e-12), showscale=i == 0,
            colorbar=dict(title="activation"),
            hovertemplate=f"feature {f}<br>a: %{{y}}<br>b: %{{x}}<br>activation: %{{z:.4g}}<extra></extra>",
        ), row=row, col=col)
        fig.update_xaxes(title_text="b", type="category", row=row, col=col)
        fig.update_yaxes(title_text="a", type="category", autorange="reversed", row=row, col=col)
    fig.update_layout(template=TEMPLATE_NAME, height=320 * rows + 80,
                      title=title or f"Layer {layer} features over the operand grid")
    return fig


@draws(PathAblationResult)
def plot_path_ablation(result: PathAblationResult, title: Optional[str] = None):
    """Bars per arm of a path ablation (its ``to_frame()`` rows): the answer logit left, as a
    share of the unablated one, with its bootstrap interval."""
    import plotly.graph_objects as go

    frame = result.to_frame()
    fig = figure(title or "Path ablation: share of the answer logit left", "features zeroed",
                 "share of the answer logit (1 = unchanged)")
    labels = [f"{arm} ({n})" for arm, n in zip(frame["arm"], frame["n_features"])]
    fig.add_trace(go.Bar(x=labels, y=frame["share"], name="share",
                         error_y=dict(type="data", symmetric=False, array=frame["share_high"] - frame["share"],
                                      arrayminus=frame["share"] - frame["share_low"]),
                         hovertemplate="%{x}: %{y:.3f}<extra></extra>"))
    return fig


@draws(GraphSample)
def plot_graph_sample(result: GraphSample, top: int = 20, title: Optional[str] = None):
    """Bars of the features most often kept in a sample's pruned graphs (its ``to_frame()`` rows)."""
    import plotly.graph_objects as go

    shown = result.to_frame().nlargest(top, "kept_fraction")
    fig = figure(title or "Features kept in the pruned graphs of a prompt sample", "feature",
                 "fraction of prompts whose pruned graph keeps it")
    names = [f"L{layer} #{f} pos {p}" for layer, f, p in zip(shown["layer"], shown["feature"], shown["position"])]
    text = [f"{label}<br>mean influence {inf:.4g}" for label, inf in zip(shown["label"], shown["mean_influence"])]
    fig.add_trace(go.Bar(x=names, y=shown["kept_fraction"], text=text, hovertemplate="%{x}: %{y:.3f}<br>%{text}"
                         "<extra></extra>"))
    return fig


@draws(FeatureInterventionResult)
def plot_feature_intervention(result: FeatureInterventionResult, title: Optional[str] = None) -> go.Figure:
    """Each prompt's answer probability with the features changed against nothing changed; the
    diagonal is no change."""
    import plotly.graph_objects as go

    how = f"clamped to {result.clamp:g}" if result.clamp is not None else f"scaled by {result.scale:g}"
    fig = figure(title or f"{len(result.features)} layer-{result.layer} features {how}: answer probability "
                          f"(accuracy {result.accuracy_before:.2f} → {result.accuracy_after:.2f})",
                 "answer probability, nothing changed", "answer probability, features changed")
    fig.add_trace(go.Scatter(x=result.prob_before.tolist(), y=result.prob_after.tolist(), mode="markers",
                             name="prompts", text=[f"prompt {i}" for i in range(len(result.answer))],
                             hovertemplate="%{text}<br>before %{x:.3g}<br>after %{y:.3g}<extra></extra>"))
    fig.add_trace(go.Scatter(x=[0, 1], y=[0, 1], mode="lines", name="no change",
                             line=dict(dash="dot", color="grey")))
    return fig


@draws(ReplacementResult)
def plot_replacement(result: ReplacementResult, title: Optional[str] = None) -> go.Figure:
    """KL(real ‖ replacement) at every answer position, one histogram per position, with the top-1
    agreement in the title."""
    import plotly.graph_objects as go

    fig = figure(title or f"Replacement model: top-1 agreement {result.agreement:.3f}, mean KL {result.kl:.3g} nats "
                          f"({result.n_positions} positions)", "KL(real ‖ replacement), nats", "positions")
    for j in range(result.kls.shape[1]):
        column = result.kls[:, j]
        fig.add_trace(go.Histogram(x=column[~column.isnan()].tolist(), name=f"answer token {j}", opacity=0.7))
    fig.update_layout(barmode="overlay")
    return fig


@draws(SwapResult)
def plot_swap(result: SwapResult, title: Optional[str] = None) -> go.Figure:
    """The swap test: the share of problems whose answer became the swapped-in token, and whose answer
    changed at all, for the labelled supernodes and for the random-feature control."""
    import plotly.graph_objects as go

    fig = figure(title or f"Swapping labelled supernodes at {result.role!r}", "", "share of problems")
    kinds = ["answer became the label's token", "answer changed"]
    fig.add_trace(go.Bar(x=kinds, y=[result.as_predicted, result.changed], name="labelled supernodes swapped",
                         hovertemplate="%{x}: %{y:.1%}<extra></extra>"))
    fig.add_trace(go.Bar(x=kinds, y=[result.as_predicted_control, result.changed_control],
                         name="as many random features", hovertemplate="%{x}: %{y:.1%}<extra></extra>"))
    fig.update_layout(barmode="group", yaxis_range=[0, 1], yaxis_tickformat=".0%")
    return fig
