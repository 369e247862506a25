"""Figures of the patching analyses: effect heatmaps, head grids, attribution scatter, effect bars."""

from __future__ import annotations

from typing import Any

import functools
import itertools

import plotly.graph_objects as go

from arithinterp.drawing import draws
from arithinterp.errors import ConfigError, accepted
from arithinterp.patching.attribution import ComparisonResult
from arithinterp.patching.attribution_result import AttributionResult
from arithinterp.patching.component_ablation import AblationResult
from arithinterp.patching.core import PatchResult
from arithinterp.patching.digits import DigitAblationResult
from arithinterp.patching.effects import EffectResult
from arithinterp.patching.faithfulness import ComponentFaithfulnessResult
from arithinterp.viz.base import answer_token_labels, to_array, bars, cycle_colour, figure, heatmap, layer_lines


_UNIT_PREFIX = {"head": "H", "neuron": "N"}
STATISTICS = ("mean", "sem", "ci_low", "ci_high")


def _value_name(result: PatchResult) -> str:
    name = result.metric + (" (normalised)" if result.normalized else "")
    return name if result.method == "exact" else f"{name}, {result.method}"


def _position_labels(result: PatchResult) -> list[str]:
    return [f"{p}: {t}" if t and t != p else str(p) for p, t in zip(result.positions, result.tokens)]


@draws(PatchResult)
def plot_patch_result(result: PatchResult, statistic: str = "mean", title: str | None = None) -> go.Figure:
    """The figure that fits the result's cells.

    layer × position: heatmap with token strings on the position axis; layer × head (or neuron):
    grid; layer × position × head (or neuron): one row per layer-head, one column per position;
    layer only: a line over layers with its bootstrap interval.
    """
    if statistic not in STATISTICS:
        raise ConfigError(f"unknown statistic {statistic!r}; accepted: {accepted(STATISTICS)}")
    values = getattr(result, statistic)
    value_name = _value_name(result) + ("" if statistic == "mean" else f" [{statistic}]")
    title = title or f"{result.method} patching of {result.site} ({result.direction}, {result.n_pairs} pairs)"
    axes = list(result.axes)
    layers = [f"L{layer}" for layer in result.layers]
    if axes == ["layer"]:
        return layer_lines(
            {value_name: values},
            title=title,
            y_title=value_name,
            layers=result.layers,
            bands={value_name: (result.ci_low, result.ci_high)} if statistic == "mean" else None,
        )
    cells = functools.partial(heatmap, title=title, value_name=value_name)
    positions = _position_labels(result)
    if axes == ["layer", "position"]:
        return cells(values, x_labels=positions, y_labels=layers, x_title="position: token", y_title="layer")
    unit = axes[-1]
    prefix = _UNIT_PREFIX[unit]
    units = result.axis_labels(unit)
    if axes == ["layer", unit]:
        return cells(values, x_labels=[f"{prefix}{u}" for u in units], y_labels=layers, x_title=unit, y_title="layer")
    # layer × position × unit: rows are (layer, unit), columns positions
    grid = to_array(values).transpose(0, 2, 1).reshape(len(layers) * len(units), -1)
    rows = [f"{layer}{prefix}{u}" for layer, u in itertools.product(layers, units)]
    return cells(grid, x_labels=positions, y_labels=rows, x_title="position: token", y_title=f"layer, {unit}")


@draws(ComparisonResult)
def plot_comparison(comparison: ComparisonResult, title: str | None = None) -> go.Figure:
    """Scatter of approximate against exact cell means, one colour per site, with the y = x line."""
    fig = figure(
        title or f"{comparison.method} vs exact patching",
        "exact patching (mean over pairs)",
        f"{comparison.method} (mean over pairs)",
    )
    low, high = 0.0, 0.0
    for i, (site, exact, approx, labels, r) in enumerate(
        zip(comparison.sites, comparison.exact, comparison.approx, comparison.cells, comparison.correlation)
    ):
        line_colour = cycle_colour(i)
        fig.add_trace(
            go.Scatter(
                x=exact,
                y=approx,
                mode="markers",
                name=f"{site} (r = {r:.3f})",
                text=labels,
                marker=dict(color=line_colour, size=7, opacity=0.8),
                hovertemplate=f"{site} %{{text}}<br>exact %{{x:.4g}}<br>approx %{{y:.4g}}<extra></extra>",
            )
        )
        low, high = min([low, *exact, *approx]), max([high, *exact, *approx])
    fig.add_trace(
        go.Scatter(
            x=[low, high],
            y=[low, high],
            mode="lines",
            name="y = x",
            line=dict(color="grey", dash="dash"),
            hoverinfo="skip",
        )
    )
    return fig


@draws(EffectResult)
def plot_effects(effects: EffectResult, title: str | None = None) -> go.Figure:
    """Direct and total effect per component, mean over pairs with standard-error bars."""
    frame = effects.to_frame()
    fig = figure(
        title or f"direct vs total effect on {effects.metric} ({effects.direction})",
        "component",
        f"change in {effects.metric}",
    )
    for column, name in (("direct", "direct effect"), ("total", "total effect")):
        fig.add_trace(
            go.Bar(
                x=frame["component"],
                y=frame[column],
                name=name,
                error_y=dict(type="data", array=frame[f"{column}_sem"]),
                hovertemplate=f"{name}<br>%{{x}}: %{{y:.4g}}<extra></extra>",
            )
        )
    fig.update_layout(barmode="group")
    return fig


@draws(AttributionResult)
def plot_attribution(result: AttributionResult, statistic: str = "mean", title: str | None = None) -> go.Figure:
    """Every site's figure (:func:`plot_patch_result`), one under another, each with its own title."""
    from plotly.subplots import make_subplots

    parts = [plot_patch_result(result[site], statistic=statistic) for site in result.sites]
    layouts: list[Any] = [part.layout for part in parts]  # plotly's layout objects are not typed
    fig = make_subplots(rows=len(parts), cols=1, subplot_titles=[layout.title.text for layout in layouts],
                        vertical_spacing=0.25 / max(len(parts), 1))
    for row, (part, layout) in enumerate(zip(parts, layouts), start=1):
        for trace in part.data:
            if isinstance(trace, go.Heatmap):
                # one colour bar per site, beside its own heatmap
                trace.update(colorbar=dict(len=1 / len(parts), y=1 - (row - 0.5) / len(parts)))
            fig.add_trace(trace, row=row, col=1)
        fig.update_xaxes(title_text=layout.xaxis.title.text, row=row, col=1)
        fig.update_yaxes(title_text=layout.yaxis.title.text, row=row, col=1)
    fig.update_layout(template=layouts[0].template, height=380 * len(parts),
                      title=title or f"{result.method} estimates of {', '.join(result.sites)} "
                                     f"({result.direction}, {result.n_pairs} pairs)")
    return fig


@draws(AblationResult)
def plot_ablation(result: AblationResult, title: str | None = None) -> go.Figure:
    """Accuracy of the full model and of the ablated one."""
    return bars(
        {"full model": result.accuracy_before, f"{result.ablation}-ablated": result.accuracy_after},
        title=title or f"accuracy after ablating {', '.join(result.components)}",
        y_title="accuracy",
    )


@draws(ComponentFaithfulnessResult)
def plot_component_faithfulness(result: ComponentFaithfulnessResult, title: str | None = None) -> go.Figure:
    """The metric with nothing, everything outside the circuit, and everything ablated."""
    return bars(
        {
            "full model": result.metric_full,
            "circuit only": result.metric_circuit,
            "everything ablated": result.metric_empty,
        },
        title=title
        or f"faithfulness {result.faithfulness:.3f} ({result.ablation} ablation, {len(result.components)} components)",
        y_title=f"mean {result.metric} of the answer",
    )


@draws(DigitAblationResult)
def plot_digit_ablation(result: DigitAblationResult, title: str | None = None) -> go.Figure:
    """Heads × answer tokens: how much each token's accuracy drops with the head ablated there."""
    return heatmap(
        result.drop,
        title=title or f"accuracy drop per answer token, one head {result.ablation}-ablated at that token's position",
        x_labels=answer_token_labels(range(result.drop.shape[1]), result.meta.get("answer_places")),
        y_labels=result.heads,
        x_title="answer token (predicted at its position)",
        y_title="head",
        value_name="accuracy drop",
        signed=False,
    )
