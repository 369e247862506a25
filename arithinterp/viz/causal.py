"""Figures of causal-variable analyses: IIA per intervention, the layers × positions heat map, and
readable (probe accuracy) against used (DAS IIA) per layer."""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go

from arithinterp.causal.results import DASLayersResult, DASResult, ReadableUsedResult
from arithinterp.drawing import draws
from arithinterp.viz.base import figure, heatmap, layer_lines


@draws(DASResult)
def plot_das(result: DASResult, **kwargs: Any) -> go.Figure:
    """Held-out IIA of DAS and each baseline with 95% intervals, chance as a dashed line."""
    names = list(result.scores)
    values = [result.scores[n]["iia"] for n in names]
    labels = [f"{n} (k={result.scores[n]['k']})" for n in names]
    fig = figure(kwargs.get("title", f"Interchange accuracy for {result.variable} at {result.site} "
                                     f"L{result.layer} @{result.position}"), "intervention", "held-out IIA")
    fig.add_trace(go.Bar(
        x=labels, y=values,
        error_y=dict(type="data", symmetric=False,
                     array=[result.scores[n]["high"] - result.scores[n]["iia"] for n in names],
                     arrayminus=[result.scores[n]["iia"] - result.scores[n]["low"] for n in names]),
        customdata=[[result.scores[n]["logit_diff"], result.scores[n]["n"]] for n in names],
        hovertemplate=("%{x}<br>IIA %{y:.3f}<br>logit diff %{customdata[0]:.3g}<br>%{customdata[1]} pairs"
                       "<extra></extra>"),
    ))
    fig.add_hline(y=result.chance, line_dash="dash", annotation_text="chance")
    fig.update_yaxes(range=[0, 1.05])
    return fig


@draws(DASLayersResult)
def plot_das_layers(result: DASLayersResult, value: str = "iia", **kwargs: Any) -> go.Figure:
    """Held-out IIA (or ``value="random_iia"`` / ``"logit_diff"``) over layers × positions."""
    grid = getattr(result, value)
    return heatmap(grid, title=kwargs.get("title", f"DAS {value} for {result.variable} ({result.site}, k={result.k})"),
                   x_labels=result.tokens or result.positions, y_labels=[f"L{layer}" for layer in result.layers],
                   x_title="position: token", y_title="layer", value_name=value, signed=value == "logit_diff")


@draws(ReadableUsedResult)
def plot_readable_used(result: ReadableUsedResult, **kwargs: Any) -> go.Figure:
    """Per variable, probe accuracy and DAS IIA over layers with their intervals, the random rotation beside."""
    frame = result.to_frame()
    series, bands = {}, {}
    for variable, rows in frame.groupby("variable", sort=False):
        series[f"{variable}: probe accuracy"] = rows["probe_accuracy"].to_numpy()
        bands[f"{variable}: probe accuracy"] = (rows["probe_low"].to_numpy(), rows["probe_high"].to_numpy())
        series[f"{variable}: DAS IIA"] = rows["das_iia"].to_numpy()
        bands[f"{variable}: DAS IIA"] = (rows["das_low"].to_numpy(), rows["das_high"].to_numpy())
        series[f"{variable}: random rotation IIA"] = rows["random_iia"].to_numpy()
    fig = layer_lines(series, title=kwargs.get("title", f"Readable vs used ({result.site} @{result.position})"),
                      y_title="accuracy", layers=sorted(set(frame["layer"].tolist())), bands=bands)
    return fig
