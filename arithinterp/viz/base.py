"""The shared template and figure helpers.

One template for the whole package (``TEMPLATE``): labelled axes with units, token strings on
position axes, ``RdBu`` centred at 0 for signed effects, numbers as colour for helix / PCA
plots, hover text with exact values.
"""
from __future__ import annotations

from typing import Optional, Sequence, cast

import numpy as np
import plotly.graph_objects as go
import plotly.io as pio

TEMPLATE_NAME = "arithinterp"
SIGNED_SCALE = "RdBu"
SEQUENTIAL_SCALE = "Viridis"
NUMBER_SCALE = "Turbo"

COLORWAY = ("#3366cc", "#dc3912", "#ff9900", "#109618", "#990099", "#0099c6", "#dd4477", "#66aa00")

TEMPLATE = go.layout.Template(pio.templates["plotly_white"])
cast(go.Layout, TEMPLATE.layout).update(
    font=dict(family="Inter, Helvetica, Arial, sans-serif", size=13),
    title=dict(x=0.02, xanchor="left", font=dict(size=16)),
    margin=dict(l=70, r=30, t=60, b=60),
    colorway=list(COLORWAY),
    hoverlabel=dict(font_size=12),
)
pio.templates[TEMPLATE_NAME] = TEMPLATE


def cycle_colour(i: int) -> str:
    """A colour of the template's colour cycle.

    Args:
        i: The index; it wraps around the cycle.

    Returns:
        The colour, as a CSS colour string.
    """
    return COLORWAY[i % len(COLORWAY)]


def to_array(values) -> np.ndarray:
    if hasattr(values, "detach"):
        values = values.detach().float().cpu().numpy()
    return np.asarray(values, dtype=float)


def figure(title: str, x_title: str, y_title: str, **layout) -> go.Figure:
    """An empty figure in the package template with labelled axes.

    Args:
        title: The figure's title.
        x_title: The x axis's title.
        y_title: The y axis's title.
        **layout: Further ``update_layout`` options.

    Returns:
        The figure.
    """
    fig = go.Figure()
    fig.update_layout(template=TEMPLATE_NAME, title=title, xaxis_title=x_title, yaxis_title=y_title, **layout)
    return fig


def position_labels(tokens: Sequence[str]) -> list[str]:
    """Unique axis labels for token strings (plotly merges duplicate categories).

    Args:
        tokens: The token strings, one per position.

    Returns:
        ``"{position}: {token}"`` labels, e.g. ``'3: +'``.
    """
    return [f"{i}: {t}" for i, t in enumerate(tokens)]


def answer_token_labels(tokens: Sequence[int], places: Optional[Sequence[str]] = None) -> list[str]:
    """Axis labels for answer tokens: the position (``answer[0]`` is the first written) and, where
    known, the digit's place.

    Args:
        tokens: The answer token indices.
        places: The place of every answer token (``meta["answer_places"]``), or ``None``.

    Returns:
        ``"answer[0] · thousands"`` labels, or ``"answer[0]"`` without places.
    """
    return [f"answer[{k}]" + (f" · {places[k]}" if places else "") for k in tokens]


def heatmap(
    values,
    *,
    title: str,
    x_labels: Sequence,
    y_labels: Sequence,
    x_title: str,
    y_title: str,
    value_name: str,
    signed: bool = True,
) -> go.Figure:
    """A heatmap of a matrix.

    Args:
        values (Float[Tensor, "y x"]): The matrix (a tensor or array).
        title: The figure's title.
        x_labels: One label per column.
        y_labels: One label per row (drawn top to bottom).
        x_title: The x axis's title.
        y_title: The y axis's title.
        value_name: The colour bar's title.
        signed: Use the diverging ``RdBu`` scale centred at 0; else a sequential one.

    Returns:
        The figure.
    """
    z = to_array(values)
    fig = figure(title, x_title, y_title)
    limit = float(np.nanmax(np.abs(z))) if z.size and np.isfinite(z).any() else 1.0
    colour = (
        dict(colorscale=SIGNED_SCALE, zmid=0.0, zmin=-limit, zmax=limit, reversescale=True)
        if signed
        else dict(colorscale=SEQUENTIAL_SCALE)
    )
    fig.add_trace(
        go.Heatmap(
            z=z,
            x=[str(x) for x in x_labels],
            y=[str(y) for y in y_labels],
            colorbar=dict(title=value_name),
            hovertemplate=f"{y_title}: %{{y}}<br>{x_title}: %{{x}}<br>{value_name}: %{{z:.4g}}<extra></extra>",
            **colour,
        )
    )
    fig.update_yaxes(autorange="reversed", type="category")
    fig.update_xaxes(type="category")
    return fig


def layer_position_heatmap(values, tokens: Sequence[str], *, title: str, value_name: str, layers=None) -> go.Figure:
    """A layer × position heatmap with token strings on the position axis.

    Args:
        values (Float[Tensor, "layer position"]): The values.
        tokens: One token string per position.
        title: The figure's title.
        value_name: The colour bar's title.
        layers: The layer of each row (default ``0..n-1``).

    Returns:
        The figure.
    """
    z = to_array(values)
    layers = list(range(z.shape[0])) if layers is None else list(layers)
    return heatmap(
        z,
        title=title,
        x_labels=position_labels(tokens),
        y_labels=[f"L{layer}" for layer in layers],
        x_title="position: token",
        y_title="layer",
        value_name=value_name,
    )


def layer_lines(
    series: dict[str, object],
    *,
    title: str,
    y_title: str,
    layers=None,
    bands: Optional[dict[str, tuple[object, object]]] = None,
) -> go.Figure:
    """One line per named series over layers, with optional confidence bands.

    Args:
        series: ``{name: values over layers}``.
        title: The figure's title.
        y_title: The y axis's title.
        layers: The x value of each point (default ``0..n-1``).
        bands: ``{name: (low, high)}`` drawn as shaded bands around the named series.

    Returns:
        The figure.
    """
    fig = figure(title, "layer", y_title)
    for i, (name, values) in enumerate(series.items()):
        y = to_array(values)
        x = list(range(len(y))) if layers is None else list(layers)
        line_colour = cycle_colour(i)
        if bands and name in bands:
            low, high = (to_array(v) for v in bands[name])
            fig.add_trace(
                go.Scatter(
                    x=x + x[::-1],
                    y=list(high) + list(low[::-1]),
                    fill="toself",
                    fillcolor=line_colour,
                    opacity=0.2,
                    line=dict(width=0),
                    hoverinfo="skip",
                    showlegend=False,
                )
            )
        fig.add_trace(
            go.Scatter(
                x=x,
                y=y,
                mode="lines+markers",
                name=name,
                line=dict(color=line_colour),
                hovertemplate=f"{name}<br>layer %{{x}}<br>{y_title}: %{{y:.4g}}<extra></extra>",
            )
        )
    fig.update_xaxes(dtick=1)
    return fig


def bars(values: dict[str, float], *, title: str, y_title: str, errors: Optional[dict[str, float]] = None) -> go.Figure:
    """A bar per named value, with optional error bars.

    Args:
        values: ``{name: value}``.
        title: The figure's title.
        y_title: The y axis's title.
        errors: ``{name: error}``, the half-width of each bar's error bar.

    Returns:
        The figure.
    """
    fig = figure(title, "", y_title)
    names = list(values)
    fig.add_trace(
        go.Bar(
            x=names,
            y=[float(values[n]) for n in names],
            error_y=dict(type="data", array=[float(errors.get(n, 0.0)) for n in names]) if errors else None,
            hovertemplate="%{x}: %{y:.4g}<extra></extra>",
        )
    )
    return fig
