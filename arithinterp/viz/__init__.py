"""Every plotly figure arithinterp draws, in one template.

``base`` holds the template and the shared helpers; each analysis has its own module of figure
builders (``viz.patching``, ``viz.probes``, ``viz.fourier``, ``viz.neurons``) that its results'
``.plot()`` methods call. Analyses never build figures inline.
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

__all__ = [
    "COLORWAY", "NUMBER_SCALE", "SEQUENTIAL_SCALE", "SIGNED_SCALE", "TEMPLATE", "TEMPLATE_NAME",
    "bars", "cycle_colour", "figure", "heatmap", "layer_lines", "layer_position_heatmap", "position_labels",
]
