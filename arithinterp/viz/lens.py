"""Figures of the logit lens: the answer's probability over layers and positions."""

from __future__ import annotations

from typing import Optional

import plotly.graph_objects as go

from arithinterp.drawing import draws
from arithinterp.errors import ConfigError, accepted
from arithinterp.lens import LogitLensResult
from arithinterp.viz.base import SEQUENTIAL_SCALE, TEMPLATE_NAME, layer_lines, to_array


LENS_VALUES = ("mean_probability", "top1")


@draws(LogitLensResult)
def plot_logit_lens(result: LogitLensResult, value: str = "mean_probability",
                    title: Optional[str] = None) -> go.Figure:
    """The logit lens of a prompt set: a layer × position heatmap of ``value`` (median rank on hover),
    or, for one position, the answer's mean probability and top-1 share over layers.

    Args:
        result: The lens.
        value: ``"mean_probability"`` (the answer token's mean probability) or ``"top1"`` (the share of
            prompts whose top lens token is the answer), drawn on the heatmap.
        title: The figure's title (default: says what was computed, on how many prompts).

    Returns:
        The figure.

    Raises:
        ConfigError: ``value`` is not one of :data:`LENS_VALUES`.
    """
    if value not in LENS_VALUES:
        raise ConfigError(f"unknown value {value!r}; accepted: {accepted(LENS_VALUES)}")
    frame = result.to_frame()
    n = result.probability.shape[0]
    if len(result.positions) == 1:
        title = title or (f"Logit lens at {result.positions[0]!r}: the answer token, each layer unembedded "
                          f"({n} prompts)")
        fig = layer_lines({"mean probability": frame["mean_probability"].to_numpy(),
                           "share of prompts with the answer on top": frame["top1"].to_numpy()},
                          title=title, y_title="fraction of prompts / probability", layers=result.layers)
        fig.update_yaxes(range=[0, 1.02])
        fig.update_layout(legend=dict(orientation="h", y=-0.2))
        return fig
    title = title or f"Logit lens: the answer token's probability, each layer unembedded ({n} prompts)"
    shape = (len(result.layers), len(result.positions))
    z = to_array(frame[value].to_numpy().reshape(shape))
    ranks = frame["median_rank"].to_numpy().reshape(shape)
    # "3: +" for an index, "final: =" for a named position
    labels = [f"{p}: {t}" for p, t in zip(result.positions, result.tokens)]
    names = {"mean_probability": "mean probability", "top1": "top-1 share"}
    fig = go.Figure(go.Heatmap(
        z=z, x=labels, y=[f"L{layer}" for layer in result.layers],
        customdata=ranks, zmin=0.0, zmax=1.0, colorscale=SEQUENTIAL_SCALE, colorbar=dict(title=names[value]),
        hovertemplate=(f"%{{y}} · %{{x}}<br>{names[value]}: %{{z:.3f}}<br>median rank: %{{customdata:.0f}}"
                       "<extra></extra>"),
    ))
    fig.update_layout(template=TEMPLATE_NAME, title=title, xaxis_title="position: the first prompt's token",
                      yaxis_title="layer (its resid_post)")
    fig.update_yaxes(type="category")
    fig.update_xaxes(type="category")
    return fig
