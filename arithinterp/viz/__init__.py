"""Every plotly figure arithinterp draws, in one template.

``base`` holds the template and the shared helpers; each analysis has its own module of figure
builders (``viz.patching``, ``viz.probes``, ``viz.fourier``, ``viz.neurons``, ``viz.circuits``,
``viz.features``, ``viz.causal``, ``viz.sweep``), each registering the builders its results'
``.plot()`` methods reach through :mod:`arithinterp.drawing`, which loads the module a figure needs;
``viz.attention`` draws the attention patterns ``collect`` reads (``plot_attention``).
Analyses never build figures inline. Every builder is named ``plot_<what>`` and takes the result
type it draws (the sweep's take its tidy tables); earlier names warn and name the new one.
``notebook`` shows a figure in a notebook as a static image (``show_static``). ``graph_view`` is
the interactive viewer of attribution graphs and circuits (one offline page each, its own script;
``graph.show()``, ``circuit.show()``).
"""

from arithinterp.viz.base import (  # noqa: F401
    COLORWAY,
    NUMBER_SCALE,
    SEQUENTIAL_SCALE,
    SIGNED_SCALE,
    TEMPLATE,
    TEMPLATE_NAME,
    bars,
    cycle_colour,
    figure,
    heatmap,
    layer_lines,
    layer_position_heatmap,
    position_labels,
)
from arithinterp.viz.attention import plot_attention  # noqa: F401
from arithinterp.viz.notebook import show_static  # noqa: F401

__all__ = [
    "COLORWAY", "NUMBER_SCALE", "SEQUENTIAL_SCALE", "SIGNED_SCALE", "TEMPLATE", "TEMPLATE_NAME",
    "bars", "cycle_colour", "figure", "heatmap", "layer_lines", "layer_position_heatmap", "plot_attention",
    "position_labels", "show_static",
]
