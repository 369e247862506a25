"""Circuit discovery: the model's graph, edge scores, circuits you can test and draw.

:mod:`~arithinterp.circuits.graph` (nodes and edges as data), :mod:`~arithinterp.circuits.edges`
(exact path patching, EAP, EAP-IG), :mod:`~arithinterp.circuits.neurons` (MLP neurons as
senders and receivers), :mod:`~arithinterp.circuits.circuit` (the :class:`Circuit` result and
its extraction), :mod:`~arithinterp.circuits.evaluation` (faithfulness curves, the faithfulness
of the kept edges, minimality, pruning, overlap), :mod:`~arithinterp.circuits.digits` (one
circuit per answer digit, teacher-forced).
"""

from arithinterp.circuits.circuit import Circuit, score_edges, threshold, top_n
from arithinterp.circuits.digits import DigitCircuits, digit_circuits
from arithinterp.circuits.edges import attribute_edges, patch_edges, run_edge_sets
from arithinterp.circuits.evaluation import (
    EdgeFaithfulnessResult,
    FaithfulnessCurveResult,
    MinimalityResult,
    OverlapResult,
    curve_sizes,
    edge_faithfulness,
    faithfulness_curve,
    minimality,
    overlap,
    prune,
)
from arithinterp.circuits.graph import Edge, EdgeGraph, Node
from arithinterp.circuits.neurons import patch_neuron_edges

__all__ = [
    "Circuit", "DigitCircuits", "Edge", "EdgeFaithfulnessResult", "EdgeGraph", "FaithfulnessCurveResult",
    "MinimalityResult", "Node", "OverlapResult", "attribute_edges", "curve_sizes", "digit_circuits",
    "edge_faithfulness", "faithfulness_curve", "minimality", "overlap", "patch_edges", "patch_neuron_edges", "prune",
    "run_edge_sets", "score_edges", "threshold", "top_n",
]
