"""An interactive viewer for attribution graphs and circuits: one self-contained page each, offline.

Three parts, one way: :mod:`~arithinterp.viz.graph_view.data` turns an
:class:`~arithinterp.features.AttributionGraph` or a :class:`~arithinterp.circuits.Circuit` into a
plain JSON-able description; :mod:`~arithinterp.viz.graph_view.page` embeds it with the viewer's
own script (``view.js``, no library, nothing fetched) in one HTML page; :class:`GraphView` shows
that page in a notebook, writes it, and embeds it in the report.

The page draws nodes by layer (rows) and token position (columns), the prompt's tokens along the
bottom; links with width by |weight| and colour by sign; a slider that prunes (source nodes by
influence for graphs, edges by |score| for circuits, starting at the pruned graph or the kept
circuit); a panel with a clicked node's label, activation, influence, strongest inputs and outputs
and, for a feature, its operand plot; supernodes collapsed into one node until clicked; and on
hover, the paths from the input tokens to the answer through a node.

``graph.show()`` / ``circuit.show()`` and ``graph.to_html(path)`` / ``circuit.to_html(path)`` call
:func:`view_graph` and :func:`view_circuit`.
"""

from __future__ import annotations

from typing import Any, Optional

from arithinterp.circuits.circuit import Circuit
from arithinterp.drawing import draws
from arithinterp.features.graph import AttributionGraph
from arithinterp.types import PositiveInt, checked
from arithinterp.viz.graph_view.data import MAX_DRAWN, MAX_LINKS, circuit_data, graph_data, graph_node_id, operand_grid
from arithinterp.viz.graph_view.page import GraphView, render_page


@draws(AttributionGraph, "show")
@checked
def view_graph(graph: Any, *, labels: Optional[dict] = None, supernodes: Any = None, grids: Any = None,
               max_links: PositiveInt = MAX_LINKS, max_drawn: PositiveInt = MAX_DRAWN) -> GraphView:
    """The interactive page of an attribution graph.

    Args:
        graph: An :class:`~arithinterp.features.AttributionGraph`.
        labels: As for :func:`graph_data`.
        supernodes: As for :func:`graph_data`.
        grids: As for :func:`graph_data`.
        max_links: As for :func:`graph_data`.
        max_drawn: As for :func:`graph_data`.

    Returns:
        The page (``_repr_html_`` draws it in a notebook; ``to_html(path)`` writes it).
    """
    return GraphView(graph_data(graph, labels=labels, supernodes=supernodes, grids=grids, max_links=max_links,
                                max_drawn=max_drawn))


@draws(Circuit, "show")
@checked
def view_circuit(circuit: Any, *, supernodes: Any = None, max_links: PositiveInt = MAX_LINKS,
                 max_drawn: PositiveInt = MAX_DRAWN) -> GraphView:
    """The interactive page of a circuit's scored edges.

    Args:
        circuit: A :class:`~arithinterp.circuits.Circuit`.
        supernodes: As for :func:`circuit_data`.
        max_links: As for :func:`circuit_data`.
        max_drawn: As for :func:`circuit_data`.

    Returns:
        The page (``_repr_html_`` draws it in a notebook; ``to_html(path)`` writes it).
    """
    return GraphView(circuit_data(circuit, supernodes=supernodes, max_links=max_links, max_drawn=max_drawn))


__all__ = ["GraphView", "MAX_DRAWN", "MAX_LINKS", "circuit_data", "graph_data", "graph_node_id", "operand_grid",
           "render_page", "view_circuit", "view_graph"]
