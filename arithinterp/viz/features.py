"""Figures of feature circuits: transcoder quality per layer."""

from __future__ import annotations

from typing import Optional

import pandas as pd

from arithinterp.viz.base import figure


def transcoder_metrics(frame: pd.DataFrame, title: Optional[str] = None):
    """Grouped bars per layer of a transcoder table (``Transcoders.to_frame()``): FVU and dead fraction."""
    import plotly.graph_objects as go

    fig = figure(title or "Transcoders: held-out reconstruction per layer", "layer", "fraction (0 = perfect)",
                 barmode="group")
    for column, name in (("fvu", "FVU (fraction of variance unexplained)"), ("dead_fraction", "dead features")):
        fig.add_trace(go.Bar(x=[f"L{layer}" for layer in frame["layer"]], y=frame[column], name=name,
                             hovertemplate="%{x}: %{y:.4f}<extra>" + name + "</extra>"))
    return fig
