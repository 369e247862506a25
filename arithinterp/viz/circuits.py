"""Circuit figures: the kept edges as a graph by layer and position, faithfulness (a curve, or the kept
edges against every edge and none), minimality and overlap."""

from __future__ import annotations

from typing import Optional

import plotly.graph_objects as go

from arithinterp.circuits.circuit import Circuit
from arithinterp.circuits.digits import DigitCircuits
from arithinterp.circuits.evaluation import (
    EdgeFaithfulnessResult, FaithfulnessCurveResult, MinimalityResult, OverlapResult,
)
from arithinterp.drawing import draws
from arithinterp.viz.base import cycle_colour, figure


POSITIVE, NEGATIVE = "#2166ac", "#b2182b"  # the ends of RdBu: helps the metric / hurts it


def _slot(kind: str, head: Optional[int], n_heads: int) -> float:
    """Vertical slot of a node inside its layer: heads 0..H−1, the MLP above them."""
    if kind == "head" and head is not None:
        return float(head)
    if kind == "mlp":
        return float(n_heads) + 0.5
    return (n_heads - 1) / 2.0  # embeddings and logits centred


@draws(Circuit)
def plot_circuit(circuit: Circuit, *, max_edges: Optional[int] = 300, title: Optional[str] = None) -> go.Figure:
    """The circuit's kept edges: x = layer (embeddings at −1, logits at ``n_layers``); y = head /
    MLP slot, one band per token position when the graph has positions; line width ∝ |score|,
    blue for edges that move the metric toward the source run, red against it; hover on an edge's
    midpoint gives its name, channel, position and score, hover on a node its name.

    ``max_edges`` draws only the largest kept edges by |score| (None: all), and says so in the title.
    """
    graph = circuit.graph()
    L = graph.layout
    labels = [p for p in graph.positions]
    band = L.n_heads + 2.5
    kept = [i for i, k in enumerate(circuit.kept.tolist()) if k]
    kept.sort(key=lambda i: -abs(float(circuit.scores[i])))
    shown = kept if max_edges is None else kept[:max_edges]
    limit = max((abs(float(circuit.scores[i])) for i in shown), default=1.0) or 1.0
    node_of = {n.name: n for n in graph.nodes}

    def xy(name: str, position) -> tuple[float, float]:
        node = node_of[name]
        p = labels.index(position) if position in labels else 0
        return float(node.layer), p * band + _slot(node.kind, node.head, L.n_heads)

    heading = title or f"Circuit ({circuit.method}, {circuit.metric}): {circuit.n_kept} of {circuit.n_edges} edges"
    if len(shown) < len(kept):
        heading += f" — largest {len(shown)} drawn"
    fig = figure(heading, "layer (embeddings −1, logits last)",
                 "head / MLP" + (" by position" if labels != [None] else ""))
    mid_x, mid_y, mid_text, mid_colour = [], [], [], []
    for i in shown:
        score = float(circuit.scores[i])
        position = circuit.positions[i]
        x0, y0 = xy(circuit.senders[i], position)
        x1, y1 = xy(circuit.receivers[i], position)
        colour = POSITIVE if score >= 0 else NEGATIVE
        fig.add_trace(go.Scatter(x=[x0, x1], y=[y0, y1], mode="lines",
                                 line=dict(width=0.5 + 7.5 * abs(score) / limit, color=colour),
                                 opacity=0.7, hoverinfo="skip", showlegend=False))
        mid_x.append((x0 + x1) / 2)
        mid_y.append((y0 + y1) / 2)
        mid_text.append(f"{circuit.edges[i]}<br>channel: {circuit.channels[i]}<br>"
                        f"position: {position if position is not None else 'all'}<br>score: {score:.4g}")
        mid_colour.append(colour)
    fig.add_trace(go.Scatter(x=mid_x, y=mid_y, mode="markers", marker=dict(size=6, color=mid_colour, opacity=0.5),
                             hovertemplate="%{text}<extra></extra>", text=mid_text, name="edges", showlegend=False))
    used = ({(circuit.senders[i], circuit.positions[i]) for i in shown}
            | {(circuit.receivers[i], circuit.positions[i]) for i in shown})
    nx, ny, nt = [], [], []
    for name, position in sorted(used, key=str):
        x, y = xy(name, position)
        nx.append(x)
        ny.append(y)
        nt.append(name + ("" if position is None else f" @ {position}"))
    fig.add_trace(go.Scatter(x=nx, y=ny, mode="markers+text", text=nt, textposition="top center", textfont=dict(size=9),
                             marker=dict(size=11, color=cycle_colour(2), line=dict(width=1, color="#333")),
                             hovertemplate="%{text}<extra></extra>", name="nodes", showlegend=False))
    ticks = list(range(-1, L.n_layers + 1))
    fig.update_xaxes(tickmode="array", tickvals=ticks,
                     ticktext=["embed"] + [f"L{l}" for l in range(L.n_layers)] + ["logits"])
    if labels != [None]:
        fig.update_yaxes(tickmode="array", tickvals=[p * band + (L.n_heads - 1) / 2 for p in range(len(labels))],
                         ticktext=[f"position {p}" for p in labels])
    else:
        fig.update_yaxes(tickmode="array", tickvals=list(range(L.n_heads)) + ([L.n_heads + 0.5] if L.has_mlp else []),
                         ticktext=[f"H{h}" for h in range(L.n_heads)] + (["MLP"] if L.has_mlp else []))
    return fig


@draws(FaithfulnessCurveResult)
def plot_faithfulness_curve(curve: FaithfulnessCurveResult, *, title: Optional[str] = None) -> go.Figure:
    """Normalised faithfulness vs number of edges kept, its bootstrap interval over pairs as a
    band, and the every-edge (1) and no-edge (0) lines. When the curve reports no fraction (the
    two end points are not distinguishable), the mean metric per size is drawn instead, with the
    reason in the title."""
    sizes = curve.sizes.tolist()
    fraction = [float(s) / curve.n_edges for s in sizes]
    if not curve.reported:
        fig = figure(title or f"Faithfulness not reported ({curve.method} ranking, {curve.ablation} ablation)",
                     "edges kept", "mean metric")
        fig.add_trace(go.Scatter(
            x=sizes, y=curve.metric_circuit.tolist(), mode="lines+markers", name="mean metric, top-k edges",
            customdata=fraction, hovertemplate="%{x} edges (%{customdata:.1%})<br>metric %{y:.4g}<extra></extra>",
        ))
        fig.add_hline(y=curve.metric_full, line_dash="dot", annotation_text=f"every edge ({curve.metric_full:.3g})")
        fig.add_hline(y=curve.metric_empty, line_dash="dot", annotation_text=f"no edge ({curve.metric_empty:.3g})")
        # the note is long: wrapped onto a few lines under the title
        words, lines = curve.note.split(), [""]
        for word in words:
            lines[-1] += ("" if not lines[-1] else " ") + word
            if len(lines[-1]) > 100:
                lines.append("")
        fig.add_annotation(text="<br>".join(line for line in lines if line), xref="paper", yref="paper", x=0, y=1,
                           xanchor="left", yanchor="top", showarrow=False, align="left", font=dict(size=10))
        return fig
    confidence = curve.meta.get("confidence", 0.95)
    fig = figure(title or f"Faithfulness ({curve.method} ranking, {curve.ablation} ablation)", "edges kept",
                 "normalised metric restored")
    band = f"{100 * confidence:g}% interval over pairs"
    fig.add_trace(go.Scatter(x=sizes + sizes[::-1], y=curve.ci_high.tolist() + curve.ci_low.tolist()[::-1],
                             fill="toself", fillcolor="rgba(33, 102, 172, 0.18)", line=dict(width=0), name=band,
                             hoverinfo="skip"))
    fig.add_trace(go.Scatter(
        x=sizes, y=curve.faithfulness.tolist(), mode="lines+markers", name="top-k edges", line=dict(color=POSITIVE),
        customdata=[list(row) for row in zip(fraction, curve.metric_circuit.tolist(), curve.ci_low.tolist(),
                                             curve.ci_high.tolist())],
        hovertemplate="%{x} edges (%{customdata[0]:.1%})<br>faithfulness %{y:.4g} "
                      f"({100 * confidence:g}% CI " "%{customdata[2]:.3g} to %{customdata[3]:.3g})<br>"
                      "metric %{customdata[1]:.4g}<extra></extra>",
    ))
    fig.add_hline(y=1.0, line_dash="dot", annotation_text=f"every edge (metric {curve.metric_full:.3g})")
    fig.add_hline(y=0.0, line_dash="dot", annotation_text=f"no edge (metric {curve.metric_empty:.3g})")
    return fig


@draws(EdgeFaithfulnessResult)
def plot_edge_faithfulness(result: EdgeFaithfulnessResult, *, title: Optional[str] = None) -> go.Figure:
    """The mean metric with no edge, with the circuit's kept edges and with every edge (the other
    edges ablated), the faithfulness and its interval over pairs in the title."""
    confidence = result.meta.get("confidence", 0.95)
    names = ["no edge", f"{result.n_kept} kept edges", "every edge"]
    values = [result.metric_empty, result.metric_circuit, result.metric_full]
    fig = figure(title or f"Faithfulness of {result.n_kept} of {result.n_edges} edges: {result.faithfulness:.3g} "
                          f"({100 * confidence:g}% CI {result.ci_low:.3g} to {result.ci_high:.3g}; "
                          f"{result.ablation} ablation)", "edges kept", f"mean metric ({result.meta.get('metric')})")
    fig.add_trace(go.Bar(x=names, y=values, marker_color=[cycle_colour(1), POSITIVE, cycle_colour(2)],
                         hovertemplate="%{x}<br>metric %{y:.4g}<extra></extra>", name="mean metric"))
    return fig


@draws(MinimalityResult)
def plot_minimality(result: MinimalityResult, *, max_edges: Optional[int] = 40,
                    title: Optional[str] = None) -> go.Figure:
    """The faithfulness each kept edge adds (lost when it alone is dropped), largest first;
    ``max_edges`` draws the largest only (None: all)."""
    order = sorted(range(len(result.edges)), key=lambda i: -float(result.loss[i]))
    shown = order if max_edges is None else order[:max_edges]
    heading = title or (f"Minimality: faithfulness lost per dropped edge (circuit {result.faithfulness:.3g}, "
                        f"{result.ablation} ablation)")
    if len(shown) < len(order):
        heading += f" — largest {len(shown)} of {len(order)}"
    fig = figure(heading, "edge", "faithfulness lost")
    fig.add_trace(go.Bar(x=[result.edges[i] for i in shown], y=[float(result.loss[i]) for i in shown],
                         customdata=[[float(result.scores[i]), float(result.without[i])] for i in shown],
                         marker_color=[POSITIVE if float(result.loss[i]) >= 0 else NEGATIVE for i in shown],
                         hovertemplate="%{x}<br>lost %{y:.4g}<br>score %{customdata[0]:.4g}<br>"
                                       "faithfulness without it %{customdata[1]:.4g}<extra></extra>",
                         name="loss"))
    return fig


@draws(OverlapResult)
def plot_overlap(result: OverlapResult, *, title: Optional[str] = None) -> go.Figure:
    """Edges and nodes kept by the first circuit only, by both, and by the second only (stacked),
    with the Jaccard indices in the title."""
    units = ["edges", "nodes"]
    a = [result.edges_a - result.edges_shared, result.nodes_a - result.nodes_shared]
    both = [result.edges_shared, result.nodes_shared]
    b = [result.edges_b - result.edges_shared, result.nodes_b - result.nodes_shared]
    fig = figure(title or f"Overlap of two circuits: edge Jaccard {result.edge_jaccard:.3g}, "
                          f"node Jaccard {result.node_jaccard:.3g}", "", "count")
    for name, values, colour in (("first only", a, cycle_colour(0)), ("both", both, POSITIVE),
                                 ("second only", b, cycle_colour(1))):
        fig.add_trace(go.Bar(x=units, y=values, name=name, marker_color=colour,
                             hovertemplate=f"{name}: " + "%{y} %{x}<extra></extra>"))
    fig.update_layout(barmode="stack")
    return fig


@draws(DigitCircuits)
def plot_digit_circuits(result: DigitCircuits, *, title: Optional[str] = None) -> go.Figure:
    """Senders × answer tokens: each sender's outgoing edge scores summed, per answer digit
    (``DigitCircuits.sender_scores``); signed, ``RdBu`` centred at 0."""
    from arithinterp.viz.base import answer_token_labels, heatmap

    names, values = result.sender_scores()
    return heatmap(
        values,
        title=title or f"{result.method} edge scores per answer token, summed per sender ({result.metric}, "
                       f"{result.meta.get('n_pairs')} pairs, vary {result.meta.get('vary')})",
        x_labels=answer_token_labels(result.answer_tokens, result.meta.get("answer_places")),
        y_labels=names,
        x_title="answer token (scored where it is emitted)",
        y_title="sender",
        value_name=f"summed edge score ({result.metric})",
    )
