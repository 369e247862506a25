"""Figures of attention patterns: a grid of small query × key heatmaps, one per layer and head, over
one prompt's tokens (the patterns :func:`arithinterp.activations.collect` reads at ``"pattern"``)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from arithinterp.checks import integer
from arithinterp.errors import ConfigError
from arithinterp.sites import check_index
from arithinterp.viz.base import SEQUENTIAL_SCALE, TEMPLATE_NAME, position_labels, to_array

if TYPE_CHECKING:
    from arithinterp.activations import Activations

CELL_PIXELS = 230  # the side of one head's heatmap


def plot_attention(acts: Activations, prompt: int = 0, *, layers: Optional[Sequence[int]] = None,
                   heads: Optional[Sequence[int]] = None, title: Optional[str] = None) -> go.Figure:
    """Attention patterns of one prompt: one query × key heatmap per layer (rows) and head (columns),
    the prompt's tokens on both axes, weights from 0 to 1 on one colour scale.

    Args:
        acts: Activations holding ``"pattern"`` (``collect(model, prompts, sites=["pattern"],
            positions="all")`` for every query; any positions give those queries' rows).
        prompt: Which prompt of ``acts.prompts`` (negative counts from the end).
        layers: The collected layers to draw (default: all of them).
        heads: The heads to draw (default: all).
        title: The figure's title (default: names the prompt).

    Returns:
        The figure: ``len(layers)`` rows × ``len(heads)`` columns of heatmaps, queries down, keys
        across, hover text with the exact weight.

    Raises:
        SiteError: ``acts`` holds no pattern, or a layer or head was not collected.
        ConfigError: ``acts`` has no prompts (it was not made by ``collect``), or ``prompt`` is out of range.
    """
    pattern = acts["pattern"]  # [prompt, layer, query, head, key]
    prompts = acts.prompts
    if prompts is None:
        raise ConfigError("these activations carry no prompts to label the axes with: collect them with "
                          "arithinterp.collect(model, prompts, sites=['pattern'])")
    n = len(prompts)
    i = integer("prompt", prompt, minimum=-n, maximum=n - 1) % n
    layer_idx = [acts.layer_index(layer) for layer in (acts.layers if layers is None else layers)]
    head_idx = check_index("heads", heads, pattern.shape[3])
    T = prompts.tokens.shape[1]
    start = T - int(prompts.lengths[i])  # the prompt's first token: keys before it are padding
    fed = pattern.shape[4] - T  # answer tokens fed after the prompt (answer positions were read)
    ids = prompts.tokens[i, start:].tolist() + prompts.answer_tokens[i, :fed].clamp(min=0).tolist()
    keys = position_labels(prompts.tokenizer.convert_ids_to_tokens(ids))
    _, where = prompts.locate(acts.positions, answers=fed)
    queries = [keys[int(q) - start] for q in where[i]]
    fig = make_subplots(rows=len(layer_idx), cols=len(head_idx), horizontal_spacing=0.03, vertical_spacing=0.06,
                        subplot_titles=[f"L{acts.layers[li]} H{h}" for li in layer_idx for h in head_idx],
                        shared_xaxes=True, shared_yaxes=True)
    for r, li in enumerate(layer_idx):
        for c, h in enumerate(head_idx):
            hover = f"L{acts.layers[li]} H{h}<br>query %{{y}}<br>key %{{x}}<br>weight %{{z:.3f}}<extra></extra>"
            fig.add_trace(go.Heatmap(z=to_array(pattern[i, li, :, h, start:]), x=keys, y=queries,
                                     coloraxis="coloraxis", hovertemplate=hover), row=r + 1, col=c + 1)
    fig.update_yaxes(autorange="reversed", type="category")
    fig.update_xaxes(type="category", tickangle=-90)
    fig.update_yaxes(title_text="query", col=1)
    fig.update_xaxes(title_text="key", row=len(layer_idx))
    text = prompts.texts[i] + (prompts.answer_texts[i] if fed else "")
    fig.update_layout(
        template=TEMPLATE_NAME, title=title or f"Attention patterns of prompt {i}: {text!r}",
        coloraxis=dict(colorscale=SEQUENTIAL_SCALE, cmin=0.0, cmax=1.0, colorbar=dict(title="attention")),
        width=max(500, 120 + CELL_PIXELS * len(head_idx)), height=max(400, 140 + CELL_PIXELS * len(layer_idx)),
    )
    return fig

