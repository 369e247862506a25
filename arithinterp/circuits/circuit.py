"""Circuits: scored edges, extraction (top-n, threshold, ACDC-style pruning), evaluation.

A :class:`Circuit` holds a score for every edge of the model's graph and which edges are kept.
:func:`score_edges` scores them (exact path patching, EAP or EAP-IG); :func:`top_n`,
:func:`threshold` and :func:`prune` choose the kept edges; :func:`faithfulness`,
:func:`minimality` and :func:`overlap` evaluate the result.

Faithfulness follows the edge-ablation convention of Conmy et al. 2023 (ACDC) and Hanna et al.
2024: run the clean prompt, make every edge *outside* the circuit carry an ablated sender output
(the corrupt prompt's — "resample" — or the mean over the clean prompts, computed by
:func:`arithinterp.engine.mean_activation`) while the circuit's edges carry whatever their
senders output in this run, and report ``(m − m_none) / (m_all − m_none)`` with ``m_all`` the
clean run (every edge kept) and ``m_none`` every edge ablated.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable, Optional, Sequence, Union

import torch

from arithinterp.circuits.edges import attribute_edges, patch_edges, run_edge_sets
from arithinterp.circuits.graph import Graph
from arithinterp.engine.edges import Layout
from arithinterp.errors import AnalysisError, ConfigError
from arithinterp.patching.core import check_choice, metric_name
from arithinterp.results import Result, build_meta

if TYPE_CHECKING:
    from arithinterp.tasks import PromptPairs
    from arithinterp.types import HookedModel

SCORE_METHODS = ("exact", "eap", "eap-ig")
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

    @property
    def n_edges(self) -> int:
        return len(self.edges)

    @property
    def n_kept(self) -> int:
        return int(self.kept.sum())

    @property
    def kept_edges(self) -> list:
        return [e for e, k in zip(self.edges, self.kept.tolist()) if k]

    def graph(self) -> Graph:
        """The graph the edges index (rebuilt from ``meta``)."""
        return Graph(Layout(**self.meta["layout"]), self.meta.get("graph_positions"))

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
        from arithinterp.viz.circuits import plot_circuit

        return plot_circuit(self, **kwargs)


@dataclass(frozen=True)
class Faithfulness(Result):
    """Normalised metric restored vs edges kept (the top-``sizes`` edges by |score|).

    ``values [K]``: ``(m − m_none) / (m_all − m_none)`` (mean over pairs); ``raw [K]`` the mean
    metric; ``all_edges`` / ``no_edges``: the mean metric with every edge kept (the clean run) and
    none (every edge ablated).
    """

    sizes: torch.Tensor
    values: torch.Tensor
    raw: torch.Tensor
    all_edges: float
    no_edges: float
    n_edges: int
    ablation: str
    method: str
    meta: dict

    def to_frame(self):
        import pandas as pd

        return pd.DataFrame(dict(edges_kept=self.sizes.tolist(), fraction=(self.sizes.float() / self.n_edges).tolist(),
                                 faithfulness=self.values.tolist(), metric=self.raw.tolist(), ablation=self.ablation,
                                 method=self.method))

    def smallest(self, target: float = 0.9) -> Optional[int]:
        """The fewest edges whose normalised faithfulness reaches ``target`` (None if none does)."""
        hit = torch.nonzero(self.values >= target).flatten()
        return None if len(hit) == 0 else int(self.sizes[hit[0]])

    def plot(self, **kwargs):
        from arithinterp.viz.circuits import plot_faithfulness

        return plot_faithfulness(self, **kwargs)


def score_edges(
    model: HookedModel,
    pairs: PromptPairs,
    method: str = "eap-ig",
    *,
    positions: Optional[Sequence] = None,
    steps: int = 5,
    metric: Union[str, Callable] = "logit_diff",
    direction: str = "denoise",
    batch_size: Optional[int] = None, max_memory: Optional[float] = None,  # None: sized from the memory budget
    progress: bool = True,
) -> Circuit:
    """Score every edge of ``model``'s graph (per position with ``positions``, e.g.
    ``["a", "b", "final"]``): ``"exact"`` path patching of each edge alone (Wang et al. 2023),
    ``"eap"`` (Syed et al. 2023) or ``"eap-ig"`` with ``steps`` interpolations (Hanna et al.
    2024). Every edge is kept; choose a subset with :func:`top_n`, :func:`threshold`, :func:`prune`.
    """
    check_choice("method", method, SCORE_METHODS)
    graph = Graph.of(model, positions)
    extra: dict = {}
    if method == "exact":
        got = patch_edges(model, pairs, graph, metric, direction, progress=progress)
        extra = dict(forwards=got["forwards"])
    else:
        got = attribute_edges(model, pairs, graph, method, steps, metric, direction, batch_size=batch_size,
                              max_memory=max_memory, progress=progress)
        extra = dict(passes=got["passes"], passes_per_batch=got["passes_per_batch"], batches=got["batches"],
                     steps=steps if method == "eap-ig" else None)
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


def _check_circuit(circuit) -> None:
    if not isinstance(circuit, Circuit):
        raise AnalysisError(f"expected a Circuit (from circuits.score_edges), got {type(circuit).__name__}")


def _order(circuit: Circuit) -> torch.Tensor:
    """Edge indices by decreasing |score| (ties: graph order)."""
    return torch.argsort(circuit.scores.abs().nan_to_num(-1.0), descending=True, stable=True)


def top_n(circuit: Circuit, n: int) -> Circuit:
    """Keep the ``n`` edges with the largest |score|."""
    _check_circuit(circuit)
    if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= circuit.n_edges:
        raise ConfigError(f"n must be an integer in 0..{circuit.n_edges} (the number of edges), got {n!r}")
    kept = torch.zeros(circuit.n_edges, dtype=torch.bool)
    kept[_order(circuit)[:n]] = True
    return circuit.with_kept(kept, f"top {n}")


def threshold(circuit: Circuit, value: float) -> Circuit:
    """Keep the edges with |score| ≥ ``value``."""
    _check_circuit(circuit)
    if not isinstance(value, (int, float)) or value < 0:
        raise ConfigError(f"threshold must be a number ≥ 0, got {value!r}")
    return circuit.with_kept(circuit.scores.abs() >= value, f"|score| >= {value}")


def _ablate(model, pairs, circuit: Circuit, kept_sets: torch.Tensor, ablation: str, metric, batch_sets=None) -> dict:
    """Mean metric per kept-set ``[C, n_edges]`` with the complement ablated, plus the end points."""
    check_choice("ablation", ablation, ABLATIONS)
    graph = circuit.graph()
    every = torch.ones(1, circuit.n_edges)
    sets = torch.cat([1.0 - kept_sets.float(), every])  # ablated edges; the last set ablates all
    got = run_edge_sets(model, pairs, graph, sets, metric, base="clean",
                        values="corrupt" if ablation == "resample" else "mean", batch_sets=batch_sets)
    raw = got["values"].mean(0)
    m_all, m_none = float(got["clean"].mean()), float(raw[-1])
    if abs(m_all - m_none) < 1e-8:
        raise AnalysisError("the metric is the same with every edge and with none; faithfulness would divide by zero")
    return dict(raw=raw[:-1], values=(raw[:-1] - m_none) / (m_all - m_none), all=m_all, none=m_none,
                forwards=got["forwards"])


def faithfulness(
    model: HookedModel,
    pairs: PromptPairs,
    circuit: Circuit,
    sizes: Optional[Sequence[int]] = None,
    *,
    ablation: str = "resample",
    metric: Union[str, Callable, None] = None,
    batch_sets: Optional[int] = None,
) -> Faithfulness:
    """Faithfulness curve: the normalised metric with the top-``k`` edges by |score| kept, for
    each ``k`` in ``sizes`` (default 0, 1, 2, 4, ... and every edge), the rest ablated
    (``"resample"``: the corrupt prompt's sender outputs; ``"mean"``: the clean prompts' mean).
    All sizes run stacked in one batch of forwards. ``metric`` defaults to the circuit's metric
    by name; a callable metric has to be passed again (a saved circuit keeps only its name)."""
    _check_circuit(circuit)
    n = circuit.n_edges
    if sizes is None:
        sizes = sorted({0, n, *[2**i for i in range(n.bit_length()) if 2**i < n]})
    sizes = [int(s) for s in sizes]
    if not sizes or any(not 0 <= s <= n for s in sizes):
        raise ConfigError(f"sizes must be edge counts in 0..{n}, got {sizes}")
    order = _order(circuit)
    kept = torch.zeros(len(sizes), n)
    for i, s in enumerate(sizes):
        kept[i, order[:s]] = 1.0
    got = _ablate(model, pairs, circuit, kept, ablation, metric or circuit.metric, batch_sets)
    return Faithfulness(
        sizes=torch.tensor(sizes), values=got["values"], raw=got["raw"], all_edges=got["all"], no_edges=got["none"],
        n_edges=n, ablation=ablation, method=circuit.method,
        meta=build_meta(model, n_pairs=len(pairs), metric=metric_name(metric or circuit.metric),
                        forwards=got["forwards"]),
    )


def circuit_faithfulness(model, pairs, circuit: Circuit, *, ablation: str = "resample", metric=None) -> float:
    """Normalised faithfulness of the circuit's kept edges (complement ablated)."""
    _check_circuit(circuit)
    return float(
        _ablate(model, pairs, circuit, circuit.kept[None].float(), ablation, metric or circuit.metric)["values"][0]
    )


def minimality(model, pairs, circuit: Circuit, *, ablation: str = "resample", metric=None,
               batch_sets: Optional[int] = None):
    """For each kept edge, the faithfulness lost when it alone is dropped from the circuit.

    Returns a DataFrame (edge, score, faithfulness without it, loss); all drops run stacked."""
    import pandas as pd

    _check_circuit(circuit)
    ids = torch.nonzero(circuit.kept).flatten()
    if len(ids) == 0:
        raise AnalysisError("the circuit keeps no edges; nothing to drop")
    sets = circuit.kept[None].float().repeat(len(ids) + 1, 1)
    sets[torch.arange(len(ids)), ids] = 0.0
    got = _ablate(model, pairs, circuit, sets, ablation, metric or circuit.metric, batch_sets)
    full = float(got["values"][-1])
    without = got["values"][:-1]
    return pd.DataFrame(dict(edge=[circuit.edges[i] for i in ids.tolist()], score=circuit.scores[ids].tolist(),
                             faithfulness_without=without.tolist(), loss=(full - without).tolist()))


def prune(
    model: HookedModel,
    pairs: PromptPairs,
    circuit: Circuit,
    tau: float = 0.01,
    *,
    ablation: str = "resample",
    metric=None,
    progress: bool = True,
) -> Circuit:
    """Greedy ACDC-style pruning verified by exact patching (Conmy et al. 2023).

    Starting from the circuit's kept edges, visit them from the logits backwards (receivers of
    later layers first; within a layer, smallest |score| first) and drop an edge when the
    normalised faithfulness falls by less than ``tau``. One stacked forward per visited edge.
    """
    from tqdm.auto import tqdm

    _check_circuit(circuit)
    if not isinstance(tau, (int, float)) or tau < 0:
        raise ConfigError(f"tau must be a number ≥ 0, got {tau!r}")
    graph = circuit.graph()
    layers = torch.tensor([graph.nodes[graph.node_index[r]].layer for r in circuit.receivers])
    ids = torch.nonzero(circuit.kept).flatten()
    key = sorted(ids.tolist(), key=lambda i: (-int(layers[i]), abs(float(circuit.scores[i]))))
    kept = circuit.kept.clone()
    current = float(_ablate(model, pairs, circuit, kept[None].float(), ablation, metric or circuit.metric)["values"][0])
    start = current
    for i in tqdm(key, desc="prune", disable=not progress):
        trial = kept.clone()
        trial[i] = False
        value = float(
            _ablate(model, pairs, circuit, trial[None].float(), ablation, metric or circuit.metric)["values"][0]
        )
        if current - value < tau:
            kept, current = trial, value
    out = circuit.with_kept(kept, f"pruned tau={tau}")
    return replace(out, meta={**out.meta, "faithfulness_before": start, "faithfulness_after": current,
                              "ablation": ablation})


def overlap(a: Circuit, b: Circuit) -> dict:
    """Shared kept edges and nodes of two circuits (e.g. of two operators or models): counts and
    Jaccard indices (|A ∩ B| / |A ∪ B|)."""
    _check_circuit(a)
    _check_circuit(b)
    ea, eb = set(a.kept_edges), set(b.kept_edges)
    na, nb = set(a.nodes), set(b.nodes)
    jac = lambda x, y: float(len(x & y) / len(x | y)) if x | y else 1.0  # noqa: E731
    return dict(edges_a=len(ea), edges_b=len(eb), edges_shared=len(ea & eb), edge_jaccard=jac(ea, eb),
                nodes_shared=len(na & nb), node_jaccard=jac(na, nb), shared_edges=sorted(ea & eb))
