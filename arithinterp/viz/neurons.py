"""Figures for heuristic neurons (Nikankin et al. 2025): K / KV maps over the operand grid, heuristic
types per layer, coverage, score heatmaps, neuron importance, and ablation bars / curves with
their controls."""

from __future__ import annotations


import numpy as np
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from arithinterp.drawing import draws
from arithinterp.errors import AnalysisError, ConfigError, accepted
from arithinterp.neurons.ablation import HeuristicAblationResult, PromptAblationResult
from arithinterp.neurons.neuron_importance import NeuronImportance
from arithinterp.neurons.neuron_maps import NeuronMaps
from arithinterp.neurons.table import HeuristicTable
from arithinterp.viz.base import SIGNED_SCALE, TEMPLATE_NAME, bars, cycle_colour, figure, heatmap


_TABLE_KINDS = ("counts", "coverage", "scores")
_MAP_KINDS = ("K", "KV", "both")


@draws(HeuristicTable)
def plot_heuristic_table(table: HeuristicTable, kind: str = "counts", max_heuristics: int = 40) -> go.Figure:
    """``"counts"``: neurons per heuristic type, stacked per layer; ``"coverage"``: fraction of the
    important neurons classified per layer; ``"scores"``: neuron × heuristic score heatmap of the
    ``max_heuristics`` heuristics with the most neurons."""
    if kind not in _TABLE_KINDS:
        raise ConfigError(f"unknown plot kind {kind!r}; accepted: {accepted(_TABLE_KINDS)}")
    if kind == "counts":
        hist = table.histogram()
        fig = figure("Heuristic types per layer", "layer", "neurons with a heuristic of this type")
        for i, (family, rows) in enumerate(hist.groupby("family", sort=False)):
            fig.add_trace(go.Bar(
                x=[f"L{l}" for l in rows.layer], y=rows.neurons, name=family, marker_color=cycle_colour(i),
                customdata=rows.labels,
                hovertemplate=f"{family}<br>%{{x}}: %{{y}} neurons, %{{customdata}} labels<extra></extra>",
            ))
        fig.update_layout(barmode="stack")
        return fig
    if kind == "coverage":
        coverage = table.coverage()
        fig = bars({f"L{l}": v for l, v in coverage.items()},
                   title=f"Classified neurons per layer (score ≥ {table.threshold:g})",
                   y_title="fraction of the layer's selected neurons")
        fig.update_xaxes(title="layer")
        fig.update_yaxes(range=[0, 1])
        return fig
    best = table.best_scores
    counts = table.labels.sum(0)
    order = np.argsort(-counts.numpy(), kind="stable")[:max_heuristics]
    order = [i for i in order if counts[i] > 0] or list(order[: min(10, len(order))])
    rows = np.argsort(-best[:, order].max(1).values.numpy(), kind="stable")
    return heatmap(
        best[rows][:, order],
        title="Heuristic scores (fraction of the top-k cells satisfying the heuristic)",
        x_labels=[table.names[i] for i in order],
        y_labels=[f"L{int(table.layer[r])}.{int(table.neuron[r])}" for r in rows],
        x_title="heuristic", y_title="neuron (layer.index)", value_name="score", signed=False,
    )


@draws(NeuronImportance)
def plot_importance(result: NeuronImportance) -> go.Figure:
    """Neuron scores of each layer sorted high to low; the selected top-k in front of a marker."""
    fig = figure(f"Neuron importance ({result.method})", "neuron rank within layer",
                 "importance (mean + std of |effect|, logit diff)")
    k = result.top.shape[1]
    for i, layer in enumerate(result.layers):
        scores = np.sort(result.scores[i].numpy())[::-1]
        fig.add_trace(go.Scatter(
            x=np.arange(len(scores)), y=scores, mode="lines", name=f"L{layer}", line=dict(color=cycle_colour(i)),
            hovertemplate=f"L{layer}<br>rank %{{x}}<br>score %{{y:.4g}}<extra></extra>",
        ))
    fig.add_vline(x=k - 0.5, line_dash="dot", line_color="grey", annotation_text=f"top {k}")
    return fig


@draws(NeuronMaps)
def plot_maps(maps: NeuronMaps, index: int = 0, kind: str = "both") -> go.Figure:
    """Neuron ``index``'s K map (activation) and/or KV map (activation × logit-lens value of the
    true answer) over the operand grid, rows a and columns b, RdBu centred at 0."""
    if kind not in _MAP_KINDS:
        raise ConfigError(f"unknown map kind {kind!r}; accepted: {accepted(_MAP_KINDS)}")
    n = maps.k_maps.shape[0]
    if not 0 <= index < n:
        raise AnalysisError(f"map index {index} is out of range; these maps hold {n} neurons (0..{n - 1})")
    name = f"L{int(maps.layer[index])}.{int(maps.neuron[index])}"
    chosen = {
        "K": [("K", maps.k_maps)],
        "KV": [("KV", maps.kv_maps)],
        "both": [("K", maps.k_maps), ("KV", maps.kv_maps)],
    }[kind]
    labels = {"K": "activation", "KV": "activation × logit of answer"}
    if len(chosen) == 1:
        which, values = chosen[0]
        return heatmap(values[index], title=f"Neuron {name}: {which} map ({maps.op})", x_labels=maps.b_values,
                       y_labels=maps.a_values, x_title="b", y_title="a", value_name=labels[which])
    fig = make_subplots(rows=1, cols=2, subplot_titles=[f"K map: {labels['K']}", f"KV map: {labels['KV']}"],
                        horizontal_spacing=0.12)
    for col, (which, values) in enumerate(chosen, start=1):
        z = values[index].numpy()
        limit = float(np.nanmax(np.abs(z))) if np.isfinite(z).any() else 1.0
        fig.add_trace(go.Heatmap(
            z=z, x=[str(b) for b in maps.b_values], y=[str(a) for a in maps.a_values],
            colorscale=SIGNED_SCALE, reversescale=True, zmid=0, zmin=-limit, zmax=limit,
            colorbar=dict(title=which, x=0.45 if col == 1 else 1.02),
            hovertemplate=f"a: %{{y}}<br>b: %{{x}}<br>{labels[which]}: %{{z:.4g}}<extra></extra>",
        ), row=1, col=col)
        fig.update_xaxes(title_text="b", type="category", row=1, col=col)
        fig.update_yaxes(title_text="a", type="category", autorange="reversed", row=1, col=col)
    fig.update_layout(template=TEMPLATE_NAME, title=f"Neuron {name} over the ({maps.op}) grid")
    return fig


@draws(HeuristicAblationResult)
def plot_heuristic_ablation(result: HeuristicAblationResult, per_heuristic: bool = False,
                            max_heuristics: int = 30) -> go.Figure:
    """Accuracy remaining after ablating each heuristic's neurons, on its associated prompts vs
    the other prompts: the mean over heuristics (default) or one pair of bars per heuristic."""
    if not per_heuristic:
        s = result.summary()
        fig = figure(f"Ablating a heuristic's neurons ({result.ablation} ablation, {s['heuristics']} heuristics)",
                     "prompts", "accuracy (mean over heuristics)")
        for i, (stage, key) in enumerate((("before", "before"), ("after ablation", "after"))):
            fig.add_trace(go.Bar(
                x=["associated prompts", "other prompts"], y=[s[f"associated_{key}"], s[f"other_{key}"]],
                name=stage, marker_color=cycle_colour(i), hovertemplate=f"{stage}<br>%{{x}}: %{{y:.4g}}<extra></extra>",
            ))
        fig.update_layout(barmode="group")
        fig.update_yaxes(range=[0, 1.05])
        return fig
    order = np.argsort(-result.n_associated.numpy(), kind="stable")[:max_heuristics]
    names = [result.heuristics[i] for i in order]
    fig = figure(f"Accuracy after ablating each heuristic's neurons ({result.ablation} ablation)", "heuristic",
                 "accuracy")
    for i, (arm, values) in enumerate(
        (("associated prompts", result.associated_after), ("other prompts", result.other_after))
    ):
        fig.add_trace(go.Bar(x=names, y=values[order].numpy(), name=arm, marker_color=cycle_colour(i),
                             hovertemplate=f"{arm}<br>%{{x}}: %{{y:.4g}}<extra></extra>"))
    fig.update_layout(barmode="group")
    fig.update_yaxes(range=[0, 1.05])
    return fig


@draws(PromptAblationResult)
def plot_prompt_ablation(result: PromptAblationResult) -> go.Figure:
    """Fraction of prompts still answered vs neurons ablated per layer: the prompt's own heuristic
    neurons against a same-size random control, with their 95% intervals over prompts where the
    result has them; the unablated share dotted."""
    fig = figure(f"Per-prompt ablation of heuristic neurons ({result.ablation} ablation)",
                 "neurons ablated per layer (k)", "fraction of prompts still answered")
    pool = "same layer's other top neurons" if result.meta.get("control", "table") == "table" else "same layer"
    for i, (arm, values, ci, sizes) in enumerate(
            (("prompt's heuristic neurons", result.heuristic_correct, result.heuristic_ci, result.n_ablated),
             (f"random control ({pool}, same count)", result.control_correct, result.control_ci,
              result.n_control if result.n_control is not None else result.n_ablated))):
        error = None if ci is None else dict(type="data", symmetric=False, array=(ci[1] - values).numpy(),
                                              arrayminus=(values - ci[0]).numpy())
        fig.add_trace(
            go.Scatter(
                x=result.ks,
                y=values.numpy(),
                error_y=error,
                mode="lines+markers",
                name=arm,
                line=dict(color=cycle_colour(i)),
                customdata=sizes.numpy(),
                hovertemplate=f"{arm}<br>k=%{{x}}<br>answered %{{y:.4g}}"
                "<br>mean neurons ablated %{customdata:.3g}<extra></extra>",
            )
        )
    fig.add_hline(
        y=result.baseline, line_dash="dot", line_color="grey", annotation_text=f"no ablation {result.baseline:.3g}"
    )
    fig.update_yaxes(range=[0, 1.05])
    return fig
