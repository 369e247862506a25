"""Circuits: scored edges and their extraction (top-n, threshold).

A :class:`Circuit` holds a score for every edge of the model's graph and which edges are kept.
:func:`score_edges` scores them (exact path patching, EAP or EAP-IG); :func:`top_n` and
:func:`threshold` choose the kept edges (as does :func:`~arithinterp.circuits.prune`, which
verifies each drop by ablation). :mod:`arithinterp.circuits.evaluation` evaluates a circuit.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Sequence, Union

import torch

from arithinterp.checks import check_belongs, check_choice
from arithinterp.circuits.edges import attribute_edges, patch_edges
from arithinterp.circuits.graph import EdgeGraph
from arithinterp.circuits.planning import AUTO_RATIO, choose_method, edge_costs
from arithinterp.drawing import draw
from arithinterp.engine.edges import Layout
from arithinterp.engine.steppers import ENGINES
from arithinterp.errors import ArithInterpError, ConfigError, ResultFileError
from arithinterp.metrics import metric_name
from arithinterp.results import BOOLEAN, DISTINCT, JSON_FILE, TENSOR_FILE, Relation, Result, build_meta
from arithinterp.types import (
    ByteSize, IntegrationSteps, NonNegativeFiniteFloat, NonNegativeInt, PositiveInt, checked,
)

if TYPE_CHECKING:

    from arithinterp.tasks import PromptPairs
    from arithinterp.types import HookedModel

SCORE_METHODS = ("exact", "eap", "eap-ig", "eap-ig-activations")
AUTO = "auto"  # score_edges only: exact patching where it costs about as much as EAP-IG, else EAP-IG
ABLATIONS = ("resample", "mean")


@dataclass(frozen=True)
class Circuit(Result):
    """Every edge of a graph with its score, and the kept subset.

    ``scores [n_edges]``: mean estimated (``eap``, ``eap-ig``) or exact effect on the metric of
    carrying the source run's sender output along that edge alone; ``pair_scores [N, n_edges]``
    per pair; ``kept [n_edges]`` bool. ``edges``, ``senders``, ``receivers``, ``channels``,
    ``positions`` describe each edge (see :class:`~arithinterp.circuits.graph.Edge`); ``nodes``
    the nodes the kept edges touch. ``meta["layout"]`` rebuilds the graph (:meth:`graph`).
    """

    scores: torch.Tensor
    pair_scores: torch.Tensor
    kept: torch.Tensor
    edges: list
    senders: list
    receivers: list
    channels: list
    positions: list
    nodes: list
    method: str
    metric: str
    meta: dict

    # what load checks: the axes fields share and the values they may take
    _shapes = {"scores": "edge", "pair_scores": "pair edge", "kept": "edge", "edges": "edge", "senders": "edge",
               "receivers": "edge", "channels": "edge", "positions": "edge"}
    _legal = {"nodes": DISTINCT, "kept": BOOLEAN}
    _relations = (Relation(
        "nodes", "every node a kept edge touches (its sender and receiver), each an edge's end", lambda v: (
            {n for n, k in zip(v["senders"], v["kept"].tolist()) if k}
            | {n for n, k in zip(v["receivers"], v["kept"].tolist()) if k})
        <= set(v["nodes"]) <= set(v["senders"]) | set(v["receivers"])),)
    _required_meta = ("layout",)

    @property
    def n_edges(self) -> int:
        return len(self.edges)

    @property
    def n_kept(self) -> int:
        return int(self.kept.sum())

    @property
    def kept_edges(self) -> list:
        return [e for e, k in zip(self.edges, self.kept.tolist()) if k]

    def headline(self) -> dict:
        """How many edges are kept, and the edge of largest score in absolute value.

        Returns:
            ``kept`` (``"n of N"``), ``top_edge`` and ``top_score``.
        """
        if not self.edges:
            return dict(kept="0 of 0")
        top = int(self.scores.abs().nan_to_num(0.0).argmax())
        return dict(kept=f"{self.n_kept} of {self.n_edges}", top_edge=self.edges[top],
                    top_score=float(self.scores[top]))

    def graph(self) -> EdgeGraph:
        """The graph the edges index (rebuilt from ``meta``)."""
        return EdgeGraph(Layout(**self.meta["layout"]), self.meta.get("graph_positions"))

    def with_kept(self, kept: torch.Tensor, how: str) -> "Circuit":
        kept = torch.as_tensor(kept, dtype=torch.bool)
        ids = torch.nonzero(kept).flatten()
        return replace(self, kept=kept, nodes=self.graph().nodes_of(ids), meta={**self.meta, "extraction": how})

    def to_frame(self):
        """One row per edge: the edge, its sender, receiver, channel, position, score and kept flag."""
        import pandas as pd

        frame = pd.DataFrame(
            dict(edge=self.edges, sender=self.senders, receiver=self.receivers, channel=self.channels,
                 position=self.positions, score=self.scores.tolist(), kept=self.kept.tolist())
        )
        frame["method"], frame["metric"] = self.method, self.metric
        return frame

    def plot(self, **kwargs):
        """The kept edges drawn by layer and position, width = |score| (see viz.circuits)."""
        return draw(self, **kwargs)

    def show(self, **options):
        """The circuit's interactive page (an inline frame in a notebook; no server): components by
        layer × position, a slider over the edges by |score| starting at the kept ones, details on
        click, paths on hover. ``options``: those of :func:`arithinterp.viz.graph_view.view_circuit`
        (``supernodes``, ``max_links``). Returns a :class:`~arithinterp.viz.graph_view.GraphView`."""
        return draw(self, "show", **options)

    def to_html(self, path: Union[str, Path], *, overwrite: bool = False, **options) -> Path:
        """Write the circuit's interactive page (:meth:`show`) to one offline HTML file, refusing an
        existing one unless ``overwrite``. Returns the file's path."""
        return self.show(**options).to_html(path, overwrite=overwrite)

    @classmethod
    def load(cls, path: Union[str, Path], *, unsealed: bool = False) -> "Circuit":
        """Read a circuit written by :meth:`save` (see :meth:`Result.load`), checking that every per-edge
        field has one entry per edge and that the saved layout rebuilds the same edges."""
        circuit = super().load(path, unsealed=unsealed)
        path = Path(path)
        tensors, text = path / TENSOR_FILE, path / JSON_FILE
        n = len(circuit.edges)
        for name in ("senders", "receivers", "channels", "positions"):
            if len(getattr(circuit, name)) != n:
                raise ResultFileError(f"{text}: field {name!r} has {len(getattr(circuit, name))} entries for {n} "
                                      "edges; a saved circuit has one per edge (the file is damaged)")
        expected = {"scores": (n,), "kept": (n,), "pair_scores": (circuit.pair_scores.shape[0], n)}
        for name, shape in expected.items():
            got = tuple(getattr(circuit, name).shape)
            if got != shape:
                raise ResultFileError(f"{tensors}: tensor {name!r} has shape {list(got)}, expected {list(shape)} "
                                      f"for the {n} edges in {text.name} (the file is damaged)")
        try:
            graph = circuit.graph()
        except (KeyError, TypeError, ArithInterpError) as e:
            raise ResultFileError(f"{text}: field 'meta.layout' does not describe a graph ({e})") from e
        if [e.name for e in graph.edges] != list(circuit.edges):
            raise ResultFileError(f"{text}: the {n} saved edges are not the {graph.n_edges} edges of the graph that "
                                  "'meta.layout' and 'meta.graph_positions' describe (the file is damaged)")
        return circuit


@checked
def score_edges(
    model: HookedModel,
    pairs: PromptPairs,
    method: str = "eap-ig",
    *,
    positions: Optional[Sequence] = None,
    ig_steps: IntegrationSteps = 5,
    metric: Union[str, Callable] = "logit_diff",
    direction: str = "denoise",
    batch_size: Optional[PositiveInt] = None,  # None: sized from the memory budget
    max_memory: Optional[ByteSize] = None,
    engine: str = "auto",
    progress: bool = True,
) -> Circuit:
    """Score every edge of ``model``'s graph (per position with ``positions``, e.g.
    ``["a", "b", "final"]``): ``"exact"`` path patching of each edge alone (Wang et al. 2023),
    ``"eap"`` (Syed et al. 2023) or ``"eap-ig"`` with ``ig_steps`` interpolation steps (Hanna et al.
    2024), or ``"eap-ig-activations"``. Every edge is kept; choose a subset with :func:`top_n`,
    :func:`threshold`, :func:`prune`. ``engine`` chooses how exact patching runs (see
    :func:`~arithinterp.circuits.run_edge_sets`).

    ``method="auto"`` picks ``"exact"`` when scoring every edge exactly is estimated to cost at
    most :data:`~arithinterp.circuits.planning.AUTO_RATIO` (2) times EAP-IG with ``ig_steps``, and
    ``"eap-ig"`` otherwise: EAP-IG estimates what exact patching measures, so where the exact
    numbers cost about as much there is no reason to take the estimate. Exact edges run from
    each receiver's layer and the first position where the pair's prompts differ, so that happens
    on shallow graphs and on few-shot prompts that differ only in their last problem (measured:
    0.5-1.0x EAP-IG's time, position-free, on the zoo models and random 4-layer Llama, Gemma 2 and
    Gemma 3 folders); per-position graphs on deeper models cost more. The estimate counts the
    multiply-adds each method's runs take (:func:`~arithinterp.circuits.planning.edge_costs`);
    both methods size their batches from ``max_memory``, so memory does not enter the choice.
    ``Circuit.method`` is the method that ran; ``meta["method_requested"]`` says ``"auto"`` and
    ``meta["cost_ratio"]`` holds the estimated exact / EAP-IG cost.

    Models that norm each attention and MLP output before adding it (Gemma 2 and 3) are scored with
    the branch norms' scales frozen at the base run (:mod:`arithinterp.engine.branch_norms`).

    Args:
        model: The hooked model.
        pairs: Counterfactual pairs of its prompts.
        method: ``"exact"``, ``"eap"``, ``"eap-ig"``, ``"eap-ig-activations"`` or ``"auto"``.
        positions: Position specs to give every node one copy per position; ``None``: one node
            per component over all positions.
        ig_steps: Integration steps of EAP-IG.
        metric: The metric on the logits (a name in :data:`arithinterp.metrics.METRICS` or a
            callable ``(logits, pairs) -> Float[Tensor, "pair"]``).
        direction: ``"denoise"`` (the clean run is patched into the corrupt one) or ``"noise"``.
        batch_size: Pairs per batch of the attribution methods; ``None``: from ``max_memory``.
        max_memory: Transient bytes the runs may use (``"1GiB"`` or an int).
        engine: How exact patching runs (:func:`~arithinterp.circuits.run_edge_sets`).
        progress: Show progress bars.

    Returns:
        Every edge's score as a :class:`Circuit` (``scores [edge]``, ``pair_scores [pair, edge]``),
        every edge kept.

    Raises:
        ConfigError: an unknown ``method`` or ``engine``; ``ig_steps`` not a positive whole number.
        AnalysisError: a model whose residual stream is not the sum of its senders' outputs.
    """
    check_belongs(model, "circuits.score_edges", pairs=pairs)
    check_choice("method", method, SCORE_METHODS + (AUTO,))
    check_choice("engine", engine, ENGINES)
    graph = EdgeGraph.of(model, positions)
    extra: dict = {}
    if method == AUTO:
        costs = edge_costs(model, pairs, graph, ig_steps, engine)
        method = choose_method(costs)
        extra.update(method_requested=AUTO, cost_ratio=round(costs.ratio, 3), auto_ratio=AUTO_RATIO)
    if method == "exact":
        got = patch_edges(model, pairs, graph, metric, direction, max_memory=max_memory, engine=engine,
                          progress=progress)
        extra.update(forwards=got["forwards"], engine=got["engine"])
    else:
        got = attribute_edges(model, pairs, graph, method, ig_steps=ig_steps, metric=metric, direction=direction,
                              batch_size=batch_size,
                              max_memory=max_memory, progress=progress)
        extra.update(passes=got["passes"], passes_per_batch=got["passes_per_batch"], batches=got["batches"],
                     ig_steps=ig_steps if method.startswith("eap-ig") else None)
    pair_scores = got["scores"].float()
    layout = graph.layout
    meta = build_meta(model, n_pairs=len(pairs), vary=getattr(pairs, "vary", None), direction=direction,
                      layout=dict(n_layers=layout.n_layers, n_heads=layout.n_heads, n_kv_heads=layout.n_kv_heads,
                                  has_mlp=layout.has_mlp, parallel=layout.parallel, d_model=layout.d_model),
                      graph_positions=None if positions is None else [str(p) for p in positions], extraction="all",
                      **extra)
    return Circuit(
        scores=pair_scores.mean(0), pair_scores=pair_scores, kept=torch.ones(graph.n_edges, dtype=torch.bool),
        edges=[e.name for e in graph.edges], senders=[e.sender for e in graph.edges],
        receivers=[e.receiver for e in graph.edges],
        channels=[e.channel for e in graph.edges], positions=[e.position for e in graph.edges],
        nodes=[n.name for n in graph.nodes], method=method, metric=metric_name(metric), meta=meta,
    )


def order_by_score(circuit: Circuit) -> torch.Tensor:
    """Edge indices by decreasing |score| (ties: graph order)."""
    return torch.argsort(circuit.scores.abs().nan_to_num(-1.0), descending=True, stable=True)


@checked
def top_n(circuit: Circuit, n: NonNegativeInt) -> Circuit:
    """Keep the ``n`` edges with the largest |score|.

    Args:
        circuit: Scored edges.
        n: How many to keep, at most ``circuit.n_edges``.

    Returns:
        The circuit with those edges kept.

    Raises:
        ConfigError: ``n`` is not a non-negative int, or is more than ``circuit.n_edges``.
    """
    if n > circuit.n_edges:  # the type and the lower bound are declared; the edge count is the circuit's
        raise ConfigError(f"n must be an integer in 0..{circuit.n_edges} (the number of edges), got {n}")
    kept = torch.zeros(circuit.n_edges, dtype=torch.bool)
    kept[order_by_score(circuit)[:n]] = True
    return circuit.with_kept(kept, f"top {n}")


@checked
def threshold(circuit: Circuit, value: NonNegativeFiniteFloat) -> Circuit:
    """Keep the edges with |score| ≥ ``value``.

    Args:
        circuit: Scored edges.
        value: The smallest |score| kept.

    Returns:
        The circuit with those edges kept.
    """
    return circuit.with_kept(circuit.scores.abs() >= value, f"|score| >= {value}")
