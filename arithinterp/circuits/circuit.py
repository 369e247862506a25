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
clean run (every edge kept) and ``m_none`` every edge ablated. The fraction is reported only when
its denominator ``m_all − m_none`` is distinguishable from zero (its percentile-bootstrap interval
over pairs excludes 0), and each value carries its bootstrap interval over pairs.
"""

from __future__ import annotations

import math
import numbers
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Callable, Optional, Sequence, Union

import torch
from pydantic import Field

from arithinterp.checks import check_belongs, check_choice, integer
from arithinterp.circuits.edges import attribute_edges, patch_edges, run_edge_sets
from arithinterp.circuits.graph import EdgeGraph
from arithinterp.circuits.planning import AUTO_RATIO, choose_method, edge_costs
from arithinterp.engine.edges import Layout
from arithinterp.engine.stepping import ENGINES
from arithinterp.errors import AnalysisError, ArithInterpError, ConfigError, ResultFileError
from arithinterp.intervals import bootstrap_counts
from arithinterp.metrics import metric_name
from arithinterp.results import DISTINCT, JSON_FILE, NON_NEGATIVE, TENSOR_FILE, Result, build_meta
from arithinterp.types import (
    Accepts, ByteSize, IndexList, NonNegativeFiniteFloat, NonNegativeInt, OpenUnitFloat, PositiveInt, Probability,
    checked,
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
    _legal = {"nodes": DISTINCT}
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
        from arithinterp.viz.circuits import plot_circuit

        return plot_circuit(self, **kwargs)

    @classmethod
    def load(cls, path: Union[str, Path]) -> "Circuit":
        """Read a circuit written by :meth:`save`, checking that every per-edge field has one
        entry per edge and that the saved layout rebuilds the same edges."""
        circuit = super().load(path)
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


@dataclass(frozen=True)
class Faithfulness(Result):
    """Normalised metric restored vs edges kept (the top-``sizes`` edges by |score|).

    ``sizes [K]`` ascending; ``values [K]``: ``(m − m_none) / (m_all − m_none)`` of the mean
    metrics over pairs, with ``ci_low`` / ``ci_high [K]`` its percentile-bootstrap interval over
    pairs (pointwise, ``meta["confidence"]``); ``raw [K]`` the mean metric; ``all_edges`` /
    ``no_edges``: the mean metric with every edge kept (the clean run) and none (every edge
    ablated). ``meta["denominator"]`` holds ``m_all − m_none`` with its interval; when that
    interval includes 0 the fraction is not reported: ``values`` and the bounds are NaN and
    ``meta["note"]`` says why (:attr:`reported` is False).
    """

    sizes: torch.Tensor
    values: torch.Tensor
    ci_low: torch.Tensor
    ci_high: torch.Tensor
    raw: torch.Tensor
    all_edges: float
    no_edges: float
    n_edges: int
    ablation: str
    method: str
    meta: dict

    # what load checks: the axes fields share and the values they may take
    _shapes = {"sizes": "size", "values": "size", "ci_low": "size", "ci_high": "size", "raw": "size"}
    _legal = {"sizes": NON_NEGATIVE, "n_edges": NON_NEGATIVE}

    @property
    def reported(self) -> bool:
        """Whether the denominator is distinguishable from zero, so ``values`` are fractions."""
        return bool(self.meta.get("denominator", {}).get("distinguishable", True))

    @property
    def note(self) -> str:
        """Why the fraction is not reported ("" when it is)."""
        return str(self.meta.get("note") or "")

    def to_frame(self):
        """One row per size: edges kept, their fraction of all edges, faithfulness with its
        interval, the raw mean metric, and ``note`` (why no fraction is given, if none is)."""
        import pandas as pd

        return pd.DataFrame(dict(edges_kept=self.sizes.tolist(), fraction=(self.sizes.float() / self.n_edges).tolist(),
                                 faithfulness=self.values.tolist(), ci_low=self.ci_low.tolist(),
                                 ci_high=self.ci_high.tolist(), metric=self.raw.tolist(), ablation=self.ablation,
                                 method=self.method, note=self.note))

    def smallest(self, target: float = 0.9) -> Optional[int]:
        """The fewest edges from which the curve stays ≥ ``target`` at every larger size measured
        (not its first crossing: a curve that reaches the target and dips below again is not
        there yet). None if the curve does not end at or above ``target``, or — with a warning —
        if the fraction is not reported (see :attr:`note`)."""
        target = _check_target(target)
        if not self.reported:
            warnings.warn(f"no faithfulness size: {self.note}", RuntimeWarning, stacklevel=2)
            return None
        return _stays_from(self.sizes, self.values, target)

    def smallest_interval(self, target: float = 0.9) -> tuple[Optional[int], Optional[int]]:
        """``(low, high)``: the sizes from which the interval's upper bound (``low``, the
        fewest edges that may suffice) and its lower bound (``high``, the fewest that suffice
        with confidence) stay ≥ ``target``; either is None when no size qualifies. Intervals are
        pointwise, so ``low ≤ smallest(target) ≤ high`` holds for the usual curve, not by
        construction. ``(None, None)`` with a warning when the fraction is not reported."""
        target = _check_target(target)
        if not self.reported:
            warnings.warn(f"no faithfulness size: {self.note}", RuntimeWarning, stacklevel=2)
            return None, None
        return _stays_from(self.sizes, self.ci_high, target), _stays_from(self.sizes, self.ci_low, target)

    def plot(self, **kwargs):
        from arithinterp.viz.circuits import plot_faithfulness

        return plot_faithfulness(self, **kwargs)


def _check_target(target) -> float:
    number = _finite(target)
    if number is None:
        raise ConfigError(f"target must be a finite number (a faithfulness such as 0.9), got {target!r}")
    return number


def _stays_from(sizes: torch.Tensor, values: torch.Tensor, target: float) -> Optional[int]:
    """The smallest size from which every value (in size order) is ≥ ``target`` (NaN counts as below)."""
    order = torch.argsort(sizes)
    below = torch.nonzero(~(values[order] >= target)).flatten()
    last = int(below[-1]) if len(below) else -1
    return None if last == len(order) - 1 else int(sizes[order[last + 1]])


@checked
def score_edges(
    model: HookedModel,
    pairs: PromptPairs,
    method: str = "eap-ig",
    *,
    positions: Optional[Sequence] = None,
    steps: int = 5,
    metric: Union[str, Callable] = "logit_diff",
    direction: str = "denoise",
    batch_size: Optional[int] = None, max_memory: Optional[ByteSize] = None,  # None: sized from the memory budget
    engine: str = "auto",
    progress: bool = True,
) -> Circuit:
    """Score every edge of ``model``'s graph (per position with ``positions``, e.g.
    ``["a", "b", "final"]``): ``"exact"`` path patching of each edge alone (Wang et al. 2023),
    ``"eap"`` (Syed et al. 2023) or ``"eap-ig"`` with ``steps`` interpolations (Hanna et al.
    2024), or ``"eap-ig-activations"``. Every edge is kept; choose a subset with :func:`top_n`,
    :func:`threshold`, :func:`prune`. ``engine`` chooses how exact patching runs (see
    :func:`~arithinterp.circuits.run_edge_sets`).

    ``method="auto"`` picks ``"exact"`` when scoring every edge exactly is estimated to cost at
    most :data:`~arithinterp.circuits.planning.AUTO_RATIO` (2) times EAP-IG with ``steps``, and
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

    Raises:
        ConfigError: an unknown ``method`` or ``engine``; ``steps`` not a positive whole number.
        AnalysisError: a model whose residual stream is not the sum of its senders' outputs.
    """
    check_belongs(model, "circuits.score_edges", pairs=pairs)
    check_choice("method", method, SCORE_METHODS + (AUTO,))
    check_choice("engine", engine, ENGINES)
    graph = EdgeGraph.of(model, positions)
    extra: dict = {}
    if method == AUTO:
        steps = integer("steps", steps, minimum=1)
        costs = edge_costs(model, pairs, graph, steps, engine)
        method = choose_method(costs)
        extra.update(method_requested=AUTO, cost_ratio=round(costs.ratio, 3), auto_ratio=AUTO_RATIO)
    if method == "exact":
        got = patch_edges(model, pairs, graph, metric, direction, max_memory=max_memory, engine=engine,
                          progress=progress)
        extra.update(forwards=got["forwards"], engine=got["engine"])
    else:
        got = attribute_edges(model, pairs, graph, method, steps, metric, direction, batch_size=batch_size,
                              max_memory=max_memory, progress=progress)
        extra.update(passes=got["passes"], passes_per_batch=got["passes_per_batch"], batches=got["batches"],
                     steps=steps if method.startswith("eap-ig") else None)
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


def _check_sizes(sizes: Sequence[int], n: int) -> list[int]:
    """Edge counts (declared non-negative ints) in ``0..n``, each once, returned ascending."""
    accepted_text = f"a list of whole edge counts in 0..{n} (the number of edges), e.g. [0, 8, 64, {n}]"
    values = [int(s) for s in sizes]
    if not values:
        raise ConfigError(f"sizes is empty; pass {accepted_text}")
    for i, s in enumerate(values):
        if s > n:
            raise ConfigError(f"sizes[{i}] = {s!r} is not a whole edge count in 0..{n}; sizes must be {accepted_text}")
    if len(set(values)) < len(values):
        twice = sorted({s for s in values if values.count(s) > 1})
        raise ConfigError(f"sizes {twice} appear more than once; pass each edge count once")
    return sorted(values)


def _finite(value) -> Optional[float]:
    """``value`` as a float when it is a finite real number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        return None
    return float(value)


def _order(circuit: Circuit) -> torch.Tensor:
    """Edge indices by decreasing |score| (ties: graph order)."""
    return torch.argsort(circuit.scores.abs().nan_to_num(-1.0), descending=True, stable=True)


@checked
def top_n(circuit: Circuit, n: NonNegativeInt) -> Circuit:
    """Keep the ``n`` edges with the largest |score|."""
    n = integer("n", n, minimum=0, maximum=circuit.n_edges, hint=" (the number of edges)")
    kept = torch.zeros(circuit.n_edges, dtype=torch.bool)
    kept[_order(circuit)[:n]] = True
    return circuit.with_kept(kept, f"top {n}")


@checked
def threshold(circuit: Circuit, value: NonNegativeFiniteFloat) -> Circuit:
    """Keep the edges with |score| ≥ ``value``."""
    return circuit.with_kept(circuit.scores.abs() >= value, f"|score| >= {value}")


def _ablate(model, pairs, circuit: Circuit, kept_sets: torch.Tensor, ablation: str, metric, batch_sets=None,
            engine: str = "auto", max_memory: Optional[ByteSize] = None, runs: Optional[dict] = None) -> dict:
    """Per-pair metrics with the complement of each kept set ``[C, n_edges]`` ablated: ``pair
    [N, C]``, the clean run ``clean [N]`` (every edge kept) and every edge ablated ``none [N]``."""
    check_choice("ablation", ablation, ABLATIONS)
    graph = circuit.graph()
    every = torch.ones(1, circuit.n_edges)
    sets = torch.cat([1.0 - kept_sets.float(), every])  # ablated edges; the last set ablates all
    got = run_edge_sets(model, pairs, graph, sets, metric, base="clean",
                        values="corrupt" if ablation == "resample" else "mean", batch_sets=batch_sets,
                        max_memory=max_memory, engine=engine, _runs=runs)
    return dict(pair=got["values"][:, :-1], clean=got["clean"], none=got["values"][:, -1], forwards=got["forwards"],
                engine=got["engine"])


def _fractions(got: dict, *, confidence: float = 0.95, n_boot: int = 1000, seed: int = 0,
               intervals: bool = True) -> dict:
    """Normalised faithfulness ``(m − m_none) / (m_all − m_none)`` of the mean metrics, each with
    a percentile-bootstrap interval over pairs (one resample of the pair index for the numerator
    and the denominator alike; NaN without ``intervals``), and the denominator with its interval.
    The fractions are NaN, and ``note`` says why, when the denominator's interval includes 0
    (beyond float round-off)."""
    cols = torch.cat([got["pair"], got["clean"][:, None], got["none"][:, None]], 1).double()  # [N, C + 2]
    n = cols.shape[0]
    counts = bootstrap_counts(n, n_boot, seed)
    # resampling every set costs n_boot × C: only the end points when no interval is wanted
    mean, boot = cols.mean(0), counts @ (cols if intervals else cols[:, -2:]) / n  # [n_boot, C + 2 or 2]
    q = torch.tensor([(1 - confidence) / 2, (1 + confidence) / 2], dtype=torch.float64)
    m_all, m_none = float(mean[-2]), float(mean[-1])
    den_boot = boot[:, -2] - boot[:, -1]
    den_low, den_high = (float(v) for v in torch.quantile(den_boot, q))
    # forwards in float32 differ by round-off even where nothing changes: not an effect
    tol = 1e-5 * max(abs(m_all), abs(m_none)) + 1e-8
    distinguishable = n >= 2 and (den_low > tol or den_high < -tol)
    denominator = dict(mean=m_all - m_none, ci_low=den_low, ci_high=den_high, confidence=confidence, n_pairs=n,
                       distinguishable=distinguishable)
    k = cols.shape[1] - 2
    nan = torch.full((k,), float("nan"))
    if not distinguishable:
        why = ("one pair gives no interval" if n < 2 else
               f"its {100 * confidence:g}% bootstrap interval over {n} pairs, {den_low:.3g} to {den_high:.3g}, "
               "includes 0")
        note = (f"faithfulness not reported: the metric with every edge ({m_all:.4g}) and with none ({m_none:.4g}) "
                f"differ by {m_all - m_none:.3g} and {why}, so a fraction of that difference would be a fraction of "
                "noise; the mean metric per size is given instead (more pairs, or pairs whose answers differ, may "
                "separate the two)")
        return dict(values=nan, low=nan, high=nan, raw=mean[:-2].float(), all=m_all, none=m_none,
                    denominator=denominator, note=note)
    values = (mean[:-2] - m_none) / (m_all - m_none)
    low = high = nan
    if intervals:
        frac = (boot[:, :-2] - boot[:, -1:]) / den_boot[:, None]
        low, high = torch.nanquantile(frac, q, dim=0)
    return dict(values=values.float(), low=low.float(), high=high.float(), raw=mean[:-2].float(), all=m_all,
                none=m_none, denominator=denominator, note=None)


def _reported(fractions: dict) -> dict:
    """``fractions``, or the AnalysisError that a fraction of noise would deserve."""
    if fractions["note"] is not None:
        raise AnalysisError(fractions["note"].replace("faithfulness not reported", "faithfulness is undefined", 1)
                            .replace("; the mean metric per size is given instead", ""))
    return fractions


@checked
def curve_sizes(n_edges: int) -> list[int]:
    """The faithfulness curve's default sizes: no edge, every power of two below ``n_edges``, every edge."""
    n_edges = integer("n_edges", n_edges, minimum=0)
    return sorted({0, n_edges, *[2**i for i in range(n_edges.bit_length()) if 2**i < n_edges]})


@checked
def faithfulness(
    model: HookedModel,
    pairs: PromptPairs,
    circuit: Circuit,
    sizes: Optional[IndexList] = None,
    *,
    ablation: str = "resample",
    metric: Union[str, Callable, None] = None,
    batch_sets: Optional[PositiveInt] = None,
    max_memory: Optional[ByteSize] = None,
    engine: str = "auto",
    confidence: OpenUnitFloat = 0.95,
    n_boot: Annotated[int, Field(ge=100), Accepts("an int >= 100 (bootstrap resamples)")] = 1000,
    seed: NonNegativeInt = 0,
) -> Faithfulness:
    """Faithfulness curve: the normalised metric with the top-``k`` edges by |score| kept, for
    each ``k`` in ``sizes`` (whole edge counts, each once, run and returned ascending; default 0,
    1, 2, 4, ... and every edge), the rest ablated (``"resample"``: the corrupt prompt's sender
    outputs; ``"mean"``: the clean prompts' mean). Each value has a ``confidence`` percentile
    bootstrap interval over pairs (``n_boot`` resamples of the pair index, ``seed``); the curve
    holds no fraction (NaN, with a note) when every edge and no edge are not distinguishable.
    All sizes run stacked in one batch of forwards (at most ``batch_sets`` sets per forward), pair
    batches and stacks sized from ``max_memory`` bytes (:func:`arithinterp.engine.budget.memory_budget`);
    ``engine`` as in :func:`~arithinterp.circuits.run_edge_sets` (``"hooks"``: whole forwards).
    ``metric`` defaults to the circuit's metric by name; a callable metric has to be passed again
    (a saved circuit keeps only its name)."""
    check_belongs(model, "circuits.faithfulness", pairs=pairs, circuit=circuit)
    n = circuit.n_edges
    if sizes is None:
        sizes = curve_sizes(n)
    sizes = _check_sizes(sizes, n)
    order = _order(circuit)
    kept = torch.zeros(len(sizes), n)
    for i, s in enumerate(sizes):
        kept[i, order[:s]] = 1.0
    got = _ablate(model, pairs, circuit, kept, ablation, metric or circuit.metric, batch_sets, engine, max_memory)
    frac = _fractions(got, confidence=confidence, n_boot=n_boot, seed=seed)
    return Faithfulness(
        sizes=torch.tensor(sizes), values=frac["values"], ci_low=frac["low"], ci_high=frac["high"], raw=frac["raw"],
        all_edges=frac["all"], no_edges=frac["none"], n_edges=n, ablation=ablation, method=circuit.method,
        meta=build_meta(model, n_pairs=len(pairs), metric=metric_name(metric or circuit.metric),
                        forwards=got["forwards"], engine=got["engine"], confidence=confidence, n_boot=n_boot,
                        seed=seed, denominator=frac["denominator"], note=frac["note"]),
    )


@checked
def circuit_faithfulness(model, pairs, circuit: Circuit, *, ablation: str = "resample",
                         metric: Union[str, Callable, None] = None,
                         engine: str = "auto") -> float:
    """Normalised faithfulness of the circuit's kept edges (complement ablated). Raises
    AnalysisError when every edge and no edge are not distinguishable (see :func:`faithfulness`)."""
    check_belongs(model, "circuits.circuit_faithfulness", pairs=pairs, circuit=circuit)
    got = _ablate(model, pairs, circuit, circuit.kept[None].float(), ablation, metric or circuit.metric,
                  engine=engine)
    return float(_reported(_fractions(got, intervals=False))["values"][0])


@checked
def minimality(model, pairs, circuit: Circuit, *, ablation: str = "resample", metric: Union[str, Callable, None] = None,
               batch_sets: Optional[PositiveInt] = None, engine: str = "auto"):
    """For each kept edge, the faithfulness lost when it alone is dropped from the circuit.

    Returns a DataFrame (edge, score, faithfulness without it, loss); all drops run stacked (at
    most ``batch_sets`` sets per forward). Raises AnalysisError when every edge and no edge are
    not distinguishable (see :func:`faithfulness`)."""
    check_belongs(model, "circuits.minimality", pairs=pairs, circuit=circuit)
    import pandas as pd

    ids = torch.nonzero(circuit.kept).flatten()
    if len(ids) == 0:
        raise AnalysisError("the circuit keeps no edges; nothing to drop")
    sets = circuit.kept[None].float().repeat(len(ids) + 1, 1)
    sets[torch.arange(len(ids)), ids] = 0.0
    got = _ablate(model, pairs, circuit, sets, ablation, metric or circuit.metric, batch_sets, engine)
    values = _reported(_fractions(got, intervals=False))["values"]
    full = float(values[-1])
    without = values[:-1]
    return pd.DataFrame(dict(edge=[circuit.edges[i] for i in ids.tolist()], score=circuit.scores[ids].tolist(),
                             faithfulness_without=without.tolist(), loss=(full - without).tolist()))


@checked
def prune(
    model: HookedModel,
    pairs: PromptPairs,
    circuit: Circuit,
    tau: Annotated[Probability, Accepts("a number in [0, 1]: the largest faithfulness drop accepted when removing "
                                        "an edge")] = 0.01,
    *,
    ablation: str = "resample",
    metric: Union[str, Callable, None] = None,
    engine: str = "auto",
    max_memory: Optional[ByteSize] = None,
    progress: bool = True,
) -> Circuit:
    """Greedy ACDC-style pruning verified by exact patching (Conmy et al. 2023).

    Starting from the circuit's kept edges, visit them from the logits backwards (receivers of
    later layers first; within a layer, smallest |score| first) and drop an edge when the
    normalised faithfulness falls by less than ``tau``. One stacked run per visited edge
    (``engine`` as in :func:`~arithinterp.circuits.run_edge_sets`); the unpatched runs are kept
    between visits for as many pairs as fit ``max_memory`` bytes (default: the engine's budget),
    the others run again at each visit.
    """
    check_belongs(model, "circuits.prune", pairs=pairs, circuit=circuit)
    from tqdm.auto import tqdm

    graph = circuit.graph()
    layers = torch.tensor([graph.nodes[graph.node_index[r]].layer for r in circuit.receivers])
    ids = torch.nonzero(circuit.kept).flatten()
    key = sorted(ids.tolist(), key=lambda i: (-int(layers[i]), abs(float(circuit.scores[i]))))
    kept = circuit.kept.clone()

    def value_of(kept_set: torch.Tensor) -> float:
        got = _ablate(model, pairs, circuit, kept_set[None].float(), ablation, metric or circuit.metric,
                      engine=engine, max_memory=max_memory, runs=runs)
        return float(_reported(_fractions(got, intervals=False))["values"][0])

    runs: dict = {}  # the unpatched runs (and mean senders), the same for every visited edge
    current = value_of(kept)
    start = current
    for i in tqdm(key, desc="prune", disable=not progress):
        trial = kept.clone()
        trial[i] = False
        value = value_of(trial)
        if current - value < tau:
            kept, current = trial, value
    out = circuit.with_kept(kept, f"pruned tau={tau}")
    return replace(out, meta={**out.meta, "faithfulness_before": start, "faithfulness_after": current,
                              "ablation": ablation})


@checked
def overlap(a: Circuit, b: Circuit) -> dict:
    """Shared kept edges and nodes of two circuits (e.g. of two operators or models): counts and
    Jaccard indices (|A ∩ B| / |A ∪ B|)."""
    pa, pb = a.meta.get("graph_positions"), b.meta.get("graph_positions")
    if (pa is None) != (pb is None):
        raise AnalysisError(
            "the circuits have different graphs: one is position-free, the other has edges per position "
            f"{pa or pb}, so no edge name can match; score both with the same positions= (None, or the same labels)")
    if pa is not None and pb is not None and list(pa) != list(pb):
        warnings.warn(f"the circuits' graphs have different positions ({pa} and {pb}): only edges at the shared "
                      "positions can match", RuntimeWarning, stacklevel=2)
    ea, eb = set(a.kept_edges), set(b.kept_edges)
    na, nb = set(a.nodes), set(b.nodes)
    jac = lambda x, y: float(len(x & y) / len(x | y)) if x | y else 1.0  # noqa: E731
    return dict(edges_a=len(ea), edges_b=len(eb), edges_shared=len(ea & eb), edge_jaccard=jac(ea, eb),
                nodes_shared=len(na & nb), node_jaccard=jac(na, nb), shared_edges=sorted(ea & eb))
