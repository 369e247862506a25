"""Figures for Fourier spectra and helix fits (:mod:`arithinterp.fourier`, :mod:`arithinterp.helix`).

Spectra carry period labels (``n/k``) on the frequency axis; helix plots colour points by the
number they represent (``NUMBER_SCALE``).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Union

import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from arithinterp.drawing import draws
from arithinterp.errors import ConfigError, accepted
from arithinterp.fourier.clusters import NeuronFrequencyResult
from arithinterp.fourier.filters import FilterResult
from arithinterp.fourier.modular import ProgressResult
from arithinterp.fourier.separability import SeparabilityResult
from arithinterp.fourier.spectrum_result import SpectrumResult
from arithinterp.helix.causal import HelixPatchResult
from arithinterp.helix.fitting import FitLayersResult, HelixFit
from arithinterp.helix.neuron_model import NeuronFitResult
from arithinterp.helix.period_search import PeriodSearchResult
from arithinterp.viz.base import (
    NUMBER_SCALE,
    TEMPLATE_NAME,
    bars,
    cycle_colour,
    figure,
    heatmap,
    layer_lines,
    to_array,
)


def _freq_labels(result: SpectrumResult) -> list[str]:
    return [f"k={k} (T={label})" if k else "const" for k, label in zip(result.frequencies, result.period_labels)]


@draws(SpectrumResult)
def plot_spectrum(result: SpectrumResult, series: Union[int, str, None] = None, *, log: bool = True,
                  include_constant: bool = False) -> go.Figure:
    """A :class:`~arithinterp.fourier.SpectrumResult` as a figure.

    One 1-D series: bars of power per frequency (key frequencies highlighted). Several series:
    a series × frequency heatmap of each series' share of its non-constant power. 2-D spectra:
    a heatmap of power per (frequency along a, frequency along b) of ``series`` (default 0).
    """
    labels = _freq_labels(result)
    start = 0 if include_constant else 1
    if result.is_2d:
        power = to_array(result.power[result._series_index(series or 0)])
        z = np.log10(power + 1e-30) if log else power
        name = result.series[result._series_index(series or 0)]
        return heatmap(z[start:, start:], title=f"2-D Fourier power: {name}",
                       x_labels=labels[start:], y_labels=labels[start:], x_title="frequency along b",
                       y_title="frequency along a", value_name="log10 power" if log else "power", signed=False)
    if series is not None or len(result.series) == 1:
        i = result._series_index(series or 0)
        power = to_array(result.power[i])[start:]
        key = set(result.key[i])
        fig = figure(f"Fourier spectrum: {result.series[i]} ({result.source})", "frequency k (period n/k)", "power")
        colours = ["#dc3912" if k in key else "#3366cc" for k in result.frequencies[start:]]
        fig.add_trace(go.Bar(x=labels[start:], y=power, marker_color=colours,
                             hovertemplate="%{x}<br>power %{y:.4g}<extra></extra>", name="power"))
        if log:
            fig.update_yaxes(type="log")
        fig.add_annotation(text=f"key frequencies (red): {sorted(key) or 'none'}; "
                                f"{float(result.key_fraction[i]):.1%} of non-constant power",
                           xref="paper", yref="paper", x=0, y=1.05, showarrow=False)
        return fig
    power = to_array(result.power)
    total = power[:, 1:].sum(1, keepdims=True)
    share = power / np.where(total > 0, total, 1.0)
    return heatmap(share[:, start:], title=f"Fourier spectra ({result.source}): share of non-constant power",
                   x_labels=labels[start:], y_labels=result.series, x_title="frequency k (period n/k)",
                   y_title="series", value_name="share", signed=False)


@draws(NeuronFrequencyResult)
def plot_neuron_frequencies(result: NeuronFrequencyResult) -> go.Figure:
    """Clustered neurons per frequency (share of variance in one block above the threshold)."""
    sizes = result.cluster_sizes()
    values = {f"k={k} (T={result.n / k:.3g})": float(v) for k, v in sizes.items()}
    fig = bars(values or {"none": 0.0}, title=(f"Neurons with > {result.threshold:.0%} of their variance in one "
                                             f"frequency: {int(result.clustered.sum())} / {len(result.best_k)}"),
               y_title="neurons")
    fig.update_xaxes(title="frequency block")
    return fig


@draws(ProgressResult)
def plot_progress(result: ProgressResult, *, log: bool = True) -> go.Figure:
    """Progress measures (losses) over training steps."""
    fig = figure(f"Progress measures (key frequencies {result.key})", "training step", "cross-entropy loss")
    for measure in result.MEASURES:
        fig.add_trace(go.Scatter(x=list(result.steps), y=to_array(getattr(result, measure)), mode="lines+markers",
                                 name=measure.replace("_", " "),
                                 hovertemplate=f"{measure}<br>step %{{x}}<br>loss %{{y:.4g}}<extra></extra>"))
    if log:
        fig.update_yaxes(type="log")
    return fig


@draws(FilterResult)
def plot_frequency_filter(result: FilterResult) -> go.Figure:
    """Distribution of answer errors with a frequency band filtered out."""
    def quoted(value: float, ci: Optional[list]) -> str:
        return f"{value:.1%}" + (f" [{ci[0]:.1%}, {ci[1]:.1%}]" if ci else "")

    fig = figure(f"Errors with {len(result.removed)} frequencies removed from {result.site} "
                 f"(accuracy {quoted(result.accuracy, getattr(result, 'accuracy_ci', None))} vs "
                 f"{quoted(result.baseline_accuracy, getattr(result, 'baseline_ci', None))})",
                 "model answer − true answer", "wrong answers")
    fig.add_trace(go.Bar(x=list(result.errors), y=list(result.counts),
                         hovertemplate="error %{x}: %{y} answers<extra></extra>"))
    return fig


def _curve_values(fit: HelixFit, n: int = 400) -> np.ndarray:
    low, high = float(fit.unique_values[:, 0].min()), float(fit.unique_values[:, 0].max())
    return np.linspace(low, high, n)


@draws(HelixFit)
def plot_helix(fit: HelixFit, view: str = "3d", **kwargs: Any) -> go.Figure:
    """A helix fit in one of its views: ``"3d"`` (:func:`plot_helix_3d`), ``"pairs"``
    (:func:`plot_helix_pairs`) or ``"periods"`` (:func:`plot_helix_periods`).

    Raises:
        ConfigError: An unknown view.
    """
    views = {"3d": plot_helix_3d, "pairs": plot_helix_pairs, "periods": plot_helix_periods}
    if view not in views:
        raise ConfigError(f"unknown view {view!r}; accepted: {accepted(views)}")
    return views[view](fit, **kwargs)


def plot_helix_3d(fit: HelixFit, components: tuple[int, int, int] = (0, 1, 2)) -> go.Figure:
    """Mean activation per value in three PCA coordinates, coloured by the number, with the
    fitted curve through them."""
    coords = to_array(fit.value_coords)
    if coords.shape[1] < 3:
        coords = np.pad(coords, ((0, 0), (0, 3 - coords.shape[1])))
    values = to_array(fit.unique_values[:, 0])
    i, j, k = components
    fig = go.Figure()
    fig.update_layout(template=TEMPLATE_NAME,
                      title=f"{fit.kind} fit: activations in PCA space, coloured by {fit.names[0]}",
                      scene=dict(xaxis_title=f"PC{i}", yaxis_title=f"PC{j}", zaxis_title=f"PC{k}"),
                      # below the plot: beside it, the legend would cover the colour bar's title
                      legend=dict(orientation="h", x=0.5, xanchor="center", y=0.0, yanchor="top"))
    fig.add_trace(go.Scatter3d(
        x=coords[:, i], y=coords[:, j], z=coords[:, k], mode="markers",
        marker=dict(size=4, color=values, colorscale=NUMBER_SCALE, colorbar=dict(title=fit.names[0])),
        text=[f"{v:g}" for v in values], name="activations",
        hovertemplate=f"{fit.names[0]}=%{{text}}<extra></extra>"))
    if len(fit.names) == 1:
        xs = _curve_values(fit)
        curve = (to_array(fit.predict(xs)) - to_array(fit.mean)) @ to_array(fit.components).T
        if curve.shape[1] < 3:
            curve = np.pad(curve, ((0, 0), (0, 3 - curve.shape[1])))
        fig.add_trace(go.Scatter3d(x=curve[:, i], y=curve[:, j], z=curve[:, k], mode="lines",
                                   line=dict(color="black", width=2), name="fit", hoverinfo="skip"))
    return fig


def plot_helix_pairs(fit: HelixFit, n_components: int = 4) -> go.Figure:
    """Pairwise 2-D projections of the top ``n_components`` PCA coordinates per value, coloured
    by the number, with the fitted curve (single-variable fits)."""
    coords = to_array(fit.value_coords)
    n_components = max(2, min(n_components, coords.shape[1]))
    values = to_array(fit.unique_values[:, 0])
    curve = None
    if len(fit.names) == 1:
        curve = (to_array(fit.predict(_curve_values(fit))) - to_array(fit.mean)) @ to_array(fit.components).T
    pairs = [(i, j) for i in range(n_components) for j in range(i + 1, n_components)]
    cols = min(3, len(pairs))
    rows = math.ceil(len(pairs) / cols)
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=[f"PC{i} vs PC{j}" for i, j in pairs])
    for n, (i, j) in enumerate(pairs):
        row, col = n // cols + 1, n % cols + 1
        fig.add_trace(go.Scatter(
            x=coords[:, i], y=coords[:, j], mode="markers", text=[f"{v:g}" for v in values],
            marker=dict(color=values, colorscale=NUMBER_SCALE, size=6, showscale=n == 0,
                        colorbar=dict(title=fit.names[0]) if n == 0 else None),
            hovertemplate=f"{fit.names[0]}=%{{text}}<br>PC{i} %{{x:.3g}}, PC{j} %{{y:.3g}}<extra></extra>",
            showlegend=False), row=row, col=col)
        if curve is not None and curve.shape[1] > j:
            fig.add_trace(go.Scatter(x=curve[:, i], y=curve[:, j], mode="lines", line=dict(color="black", width=1),
                                     hoverinfo="skip", showlegend=False), row=row, col=col)
        fig.update_xaxes(title_text=f"PC{i}", row=row, col=col)
        fig.update_yaxes(title_text=f"PC{j}", row=row, col=col)
    fig.update_layout(template=TEMPLATE_NAME,
                      title=f"{fit.kind} fit: pairwise PCA projections, coloured by {fit.names[0]}")
    return fig


def plot_helix_periods(fit: HelixFit) -> go.Figure:
    """For each period T, the activations projected onto the fit's (cos T, sin T) plane
    (least squares onto the two coefficient directions), coloured by the number."""
    labels = fit.labels
    periods = [T for T in fit.periods if f"cos(2π{fit.names[0]}/{T:g})" in labels]
    if not periods:
        fig = figure("no periodic terms in this fit", "", "")
        return fig
    coords = to_array(fit.value_coords)
    coef = to_array(fit.coef)[:, : coords.shape[1]]
    values = to_array(fit.unique_values[:, 0])
    cols = min(4, len(periods))
    rows = math.ceil(len(periods) / cols)
    fig = make_subplots(rows=rows, cols=cols, subplot_titles=[f"T = {T:g}" for T in periods])
    for n, T in enumerate(periods):
        plane = coef[[labels.index(f"cos(2π{fit.names[0]}/{T:g})"), labels.index(f"sin(2π{fit.names[0]}/{T:g})")]]
        projected = coords @ np.linalg.pinv(plane)
        fig.add_trace(go.Scatter(
            x=projected[:, 0], y=projected[:, 1], mode="markers", text=[f"{v:g}" for v in values],
            marker=dict(color=values, colorscale=NUMBER_SCALE, size=6, showscale=n == 0,
                        colorbar=dict(title=fit.names[0]) if n == 0 else None),
            hovertemplate=f"{fit.names[0]}=%{{text}}<br>cos %{{x:.3g}}, sin %{{y:.3g}}<extra></extra>",
            showlegend=False),
            row=n // cols + 1, col=n % cols + 1)
    fig.update_layout(template=TEMPLATE_NAME, title=f"Activations in each period's plane ({fit.kind} fit)")
    fig.update_xaxes(title="cos coordinate")
    fig.update_yaxes(title="sin coordinate", scaleanchor="x")
    return fig


@draws(FitLayersResult)
def plot_fit_layers(result: FitLayersResult) -> go.Figure:
    """Held-out R² of each fit per layer."""
    return layer_lines({name: result.r2[i] for i, name in enumerate(result.fits)}, layers=result.layers,
                       title=f"Held-out R² per layer (periods {', '.join(f'{T:g}' for T in result.periods)})",
                       y_title="held-out R² (full space)")


@draws(HelixPatchResult)
def plot_helix_patch(result: HelixPatchResult) -> go.Figure:
    """Mean corrupt-answer logit change per patch method with its 95% bootstrap interval over
    pairs; bars are labelled with their fraction of the layer patch (and its interval) only when
    the layer patch's effect is distinguishable from zero, else the title says so."""
    frame = result.to_frame()
    title = f"Causal patch test at {result.site}, layer {result.layer}, position {result.position!r}"
    if not getattr(result, "layer_patch_distinct", True):
        title += "<br><sub>no fractions: " + result.note + "</sub>"
    fig = bars(dict(zip(frame["method"], frame["effect"])), title=title, y_title="Δ logit of the corrupted answer")
    if bool(frame["effect_ci_low"].notna().all()):
        fig.update_traces(error_y=dict(type="data", symmetric=False,
                                       array=(frame["effect_ci_high"] - frame["effect"]).tolist(),
                                       arrayminus=(frame["effect"] - frame["effect_ci_low"]).tolist()))
    if getattr(result, "layer_patch_distinct", True):
        fig.update_traces(text=[f"{f:.0%} [{lo:.0%}, {hi:.0%}]" if math.isfinite(lo) else f"{f:.0%}" for f, lo, hi in
                                zip(frame.fraction_of_layer_patch, frame.fraction_ci_low, frame.fraction_ci_high)],
                          textposition="outside")
    return fig


@draws(SeparabilityResult)
def plot_separability(result: SeparabilityResult, series: Union[int, str] = 0) -> go.Figure:
    """Mod-T linear separability of one series: the probe's held-out accuracy per period with its
    95% interval, next to the random-init model, the shuffled numbers and chance (Fu et al. 2026)."""
    s = result.series.index(series) if isinstance(series, str) else int(series)
    periods = [f"T={T}" for T in result.periods]
    fig = figure(f"Is x mod T linearly readable? ({result.series[s]})", "period", "held-out accuracy of x mod T")
    acc, low, high = (to_array(t) for t in (result.accuracy[s], result.ci[0, s], result.ci[1, s]))
    fig.add_trace(go.Bar(x=periods, y=acc, name="trained model", marker_color=cycle_colour(0),
                         error_y=dict(type="data", symmetric=False, array=high - acc, arrayminus=acc - low),
                         hovertemplate="%{x}: %{y:.3f}<extra>trained model</extra>"))
    if result.random_init is not None and result.random_init_ci is not None:
        r_acc, r_low, r_high = (to_array(t) for t in (result.random_init[s], result.random_init_ci[0, s],
                                                      result.random_init_ci[1, s]))
        fig.add_trace(go.Bar(x=periods, y=r_acc, name="random-init model", marker_color=cycle_colour(1),
                             error_y=dict(type="data", symmetric=False, array=r_high - r_acc, arrayminus=r_acc - r_low),
                             hovertemplate="%{x}: %{y:.3f}<extra>random-init model</extra>"))
    fig.add_trace(go.Bar(x=periods, y=to_array(result.shuffled[s]), name="numbers shuffled", marker_color="lightgrey",
                         hovertemplate="%{x}: %{y:.3f}<extra>numbers shuffled</extra>"))
    fig.add_trace(go.Scatter(x=periods, y=to_array(result.chance), mode="markers", name="chance (largest class)",
                             marker=dict(symbol="line-ew-open", size=30, color="black"),
                             hovertemplate="%{x}: chance %{y:.3f}<extra></extra>"))
    fig.update_layout(barmode="group")
    fig.update_yaxes(range=[0, 1.05])
    return fig


@draws(PeriodSearchResult)
def plot_period_search(result: PeriodSearchResult) -> go.Figure:
    """Best score per subset size, labelled with the winning periods."""
    values = {f"{len(s)}: {', '.join(f'{T:g}' for T in s)}": float(v) for s, v in zip(result.best, result.best_scores)}
    fig = bars(values, title="Best period subset of each size", y_title=result.criterion)
    fig.update_xaxes(title="size: periods")
    return fig


@draws(NeuronFitResult)
def plot_neuron_fits(result: NeuronFitResult, *, bins: Optional[int] = 30) -> go.Figure:
    """Histogram of the neuron fits' NRMSE."""
    fig = figure(f"Neuron preactivation fits ({result.method}): NRMSE", "NRMSE = RMSE / (max − min)", "neurons")
    fig.add_trace(go.Histogram(x=to_array(result.nrmse), nbinsx=bins, hovertemplate="NRMSE %{x}: %{y}<extra></extra>"))
    return fig
