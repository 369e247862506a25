"""Figures of feature circuits: transcoder quality per layer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import pandas as pd

from arithinterp.viz.base import figure, renamed

if TYPE_CHECKING:
    import plotly.graph_objects as go

    from arithinterp.features.graph import Graph


def plot_transcoder_metrics(frame: pd.DataFrame, title: Optional[str] = None) -> go.Figure:
    """Grouped bars per layer of a transcoder table (``Transcoders.to_frame()``): FVU and dead fraction."""
    import plotly.graph_objects as go

    fig = figure(title or "Transcoders: held-out reconstruction per layer", "layer", "fraction (0 = perfect)",
                 barmode="group")
    for column, name in (("fvu", "FVU (fraction of variance unexplained)"), ("dead_fraction", "dead features")):
        fig.add_trace(go.Bar(x=[f"L{layer}" for layer in frame["layer"]], y=frame[column], name=name,
                             hovertemplate="%{x}: %{y:.4f}<extra>" + name + "</extra>"))
    return fig


def plot_attribution_graph(graph: Graph, kept_only: bool = True, title: Optional[str] = None) -> go.Figure:
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


# the old names still work, with a DeprecationWarning naming the new one
__getattr__ = renamed(__name__, {
    "transcoder_metrics": "plot_transcoder_metrics",
    "attribution_graph": "plot_attribution_graph",
})
