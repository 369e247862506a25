"""Evaluating a circuit: faithfulness (a curve over sizes, or of the kept edges), minimality,
ACDC-style pruning, and the overlap of two circuits.

One module past 600 lines on purpose: the four share one way of running edge sets (:func:`run_edge_sets`)
and one denominator convention (its bootstrap test), which a split would scatter across modules.

Faithfulness follows the edge-ablation convention of Conmy et al. 2023 (ACDC) and Hanna et al.
2024: run the clean prompt, make every edge *outside* the circuit carry an ablated sender output
(the corrupt prompt's — "resample" — or the mean over the clean prompts, computed by
:func:`arithinterp.engine.mean_activation`) while the circuit's edges carry whatever their
senders output in this run, and report ``(m − m_empty) / (m_full − m_empty)`` with ``m_full`` the
clean run (every edge kept) and ``m_empty`` every edge ablated. The fraction is reported only when
its denominator ``m_full − m_empty`` is distinguishable from zero (its percentile-bootstrap interval
over pairs excludes 0), and each value carries its bootstrap interval over pairs.

:func:`faithfulness_curve` measures the top-``k`` edges by |score| for several ``k``
(:class:`FaithfulnessCurveResult`); :func:`edge_faithfulness` the circuit's kept edges
(:class:`EdgeFaithfulnessResult`); :func:`minimality` what each kept edge adds
(:class:`MinimalityResult`); :func:`overlap` what two circuits share (:class:`OverlapResult`).
The faithfulness of a circuit of components (heads and MLPs) is
:func:`arithinterp.patching.component_faithfulness`.

One module past 500 lines on purpose: the four evaluations share the ablated-edge runs and their
bootstrap intervals over pairs.
"""

from __future__ import annotations

import math
import numbers
import warnings
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Annotated, Callable, Optional, Sequence, Union

import torch
from pydantic import Field

from arithinterp.checks import check_belongs, check_choice
from arithinterp.circuits.circuit import ABLATIONS, Circuit, order_by_score
from arithinterp.circuits.edges import run_edge_sets
from arithinterp.drawing import draw
from arithinterp.errors import AnalysisError, ConfigError
from arithinterp.intervals import bootstrap_counts
from arithinterp.metrics import metric_name
from arithinterp.results import DISTINCT, NON_NEGATIVE, PROBABILITY, Result, build_meta
from arithinterp.types import (
    Accepts, ByteSize, IndexList, NonNegativeInt, OpenUnitFloat, PositiveInt, Probability, checked,
)

if TYPE_CHECKING:
    import pandas as pd
    import plotly.graph_objects as go

    from arithinterp.tasks import PromptPairs
    from arithinterp.types import HookedModel

Bootstraps = Annotated[int, Field(ge=100), Accepts("an int >= 100 (bootstrap resamples)")]


@dataclass(frozen=True)
class FaithfulnessCurveResult(Result):
    """Normalised metric restored vs edges kept (the top-``sizes`` edges by |score|).

    ``sizes [K]`` ascending; ``faithfulness [K]``: ``(m − m_empty) / (m_full − m_empty)`` of the
    mean metrics over pairs, with ``ci_low`` / ``ci_high [K]`` its percentile-bootstrap interval over
    pairs (pointwise, ``meta["confidence"]``); ``metric_circuit [K]`` the mean metric with the top-k
    edges; ``metric_full`` / ``metric_empty``: the mean metric with every edge kept (the clean run)
    and none (every edge ablated) — the fields of :class:`arithinterp.patching.ComponentFaithfulnessResult`.
    ``meta["denominator"]`` holds ``m_full − m_empty`` with its interval; when that
    interval includes 0 the fraction is not reported: ``faithfulness`` and the bounds are NaN and
    ``meta["note"]`` says why (:attr:`reported` is False).
    """

    sizes: torch.Tensor
    faithfulness: torch.Tensor
    ci_low: torch.Tensor
    ci_high: torch.Tensor
    metric_circuit: torch.Tensor
    metric_full: float
    metric_empty: float
    n_edges: int
    ablation: str
    method: str
    meta: dict

    # what load checks: the axes fields share and the values they may take
    _shapes = {"sizes": "size", "faithfulness": "size", "ci_low": "size", "ci_high": "size",
               "metric_circuit": "size"}
    _legal = {"sizes": NON_NEGATIVE, "n_edges": NON_NEGATIVE, "ablation": ABLATIONS}

    @property
    def reported(self) -> bool:
        """Whether the denominator is distinguishable from zero, so ``faithfulness`` holds fractions."""
        return bool(self.meta.get("denominator", {}).get("distinguishable", True))

    @property
    def note(self) -> str:
        """Why the fraction is not reported ("" when it is)."""
        return str(self.meta.get("note") or "")

    def to_frame(self):
        """One row per size: edges kept, their fraction of all edges, faithfulness with its
        interval, the mean metric with the top-k edges (``metric_circuit``), and ``note`` (why no
        fraction is given, if none is)."""
        import pandas as pd

        return pd.DataFrame(dict(edges_kept=self.sizes.tolist(), fraction=(self.sizes.float() / self.n_edges).tolist(),
                                 faithfulness=self.faithfulness.tolist(), ci_low=self.ci_low.tolist(),
                                 ci_high=self.ci_high.tolist(), metric_circuit=self.metric_circuit.tolist(),
                                 ablation=self.ablation,
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
        return _stays_from(self.sizes, self.faithfulness, target)

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
        return draw(self, **kwargs)


@dataclass(frozen=True)
class EdgeFaithfulnessResult(Result):
    """The faithfulness of a circuit's kept edges, every other edge ablated.

    Attributes:
        faithfulness: ``(m − m_empty) / (m_full − m_empty)`` of the mean metrics over pairs.
        ci_low: The lower end of its percentile-bootstrap interval over pairs
            (``meta["confidence"]``).
        ci_high: The upper end of that interval.
        metric_circuit: The mean metric with the kept edges alone.
        metric_full: The mean metric with every edge kept (the clean run).
        metric_empty: The mean metric with every edge ablated.
        n_kept: The edges kept.
        n_edges: The edges of the graph.
        ablation: What the ablated edges carry: ``"resample"`` (the corrupt prompt's sender
            outputs) or ``"mean"`` (the clean prompts' mean).
        method: How the circuit's edges were scored.
        meta: Provenance, the metric and the denominator ``m_full − m_empty`` with its interval; when
            that interval includes 0 the fraction is not reported: ``faithfulness`` and its interval are
            NaN and ``meta["note"]`` says why (:attr:`reported` is False).
    """

    faithfulness: float
    ci_low: float
    ci_high: float
    metric_circuit: float
    metric_full: float
    metric_empty: float
    n_kept: int
    n_edges: int
    ablation: str
    method: str
    meta: dict

    # what load checks: the values fields may take
    _legal = {"n_kept": NON_NEGATIVE, "n_edges": NON_NEGATIVE, "ablation": ABLATIONS}

    @property
    def reported(self) -> bool:
        """Whether the denominator is distinguishable from zero, so ``faithfulness`` is a fraction."""
        return bool(self.meta.get("denominator", {}).get("distinguishable", True))

    @property
    def note(self) -> str:
        """Why the fraction is not reported ("" when it is)."""
        return str(self.meta.get("note") or "")

    def to_frame(self) -> pd.DataFrame:
        """One row: edges kept, their fraction of all edges, faithfulness with its interval, the
        mean metric with the kept edges, every edge and none, and ``note`` (why no fraction is
        given, if none is)."""
        import pandas as pd

        return pd.DataFrame([dict(edges_kept=self.n_kept, fraction=self.n_kept / max(self.n_edges, 1),
                                  faithfulness=self.faithfulness, ci_low=self.ci_low, ci_high=self.ci_high,
                                  metric_circuit=self.metric_circuit, metric_full=self.metric_full,
                                  metric_empty=self.metric_empty,
                                  ablation=self.ablation, method=self.method, note=self.note)])

    def plot(self, **kwargs) -> go.Figure:
        """The mean metric with no edge, the kept edges and every edge (see viz.circuits)."""
        return draw(self, **kwargs)


@dataclass(frozen=True)
class MinimalityResult(Result):
    """What each kept edge adds: the faithfulness lost when it alone is dropped from the circuit.

    Attributes:
        edges: The circuit's kept edges ``[edge]``.
        scores: Their scores ``[edge]``.
        without: The circuit's faithfulness without each edge ``[edge]``.
        loss: ``faithfulness − without`` ``[edge]``: what dropping the edge costs.
        faithfulness: The faithfulness of the whole circuit.
        ablation: What the ablated edges carry (``"resample"`` or ``"mean"``).
        method: How the circuit's edges were scored.
        meta: Provenance and the metric; when every edge and no edge are not distinguishable the
            faithfulness is not reported (``faithfulness``, ``without`` and ``loss`` NaN) and
            ``meta["note"]`` says why (:attr:`reported` is False).
    """

    edges: list
    scores: torch.Tensor
    without: torch.Tensor
    loss: torch.Tensor
    faithfulness: float
    ablation: str
    method: str
    meta: dict

    # what load checks: the axes fields share and the values they may take
    _shapes = {"edges": "edge", "scores": "edge", "without": "edge", "loss": "edge"}
    _legal = {"edges": DISTINCT, "ablation": ABLATIONS}

    @property
    def reported(self) -> bool:
        """Whether every edge and no edge are distinguishable, so the values are fractions."""
        return not self.meta.get("note")

    def to_frame(self) -> pd.DataFrame:
        """One row per kept edge: its score, the faithfulness without it and the loss."""
        import pandas as pd

        return pd.DataFrame(dict(edge=self.edges, score=self.scores.tolist(),
                                 faithfulness_without=self.without.tolist(), loss=self.loss.tolist()))

    def plot(self, **kwargs) -> go.Figure:
        """The loss per kept edge, largest first (see viz.circuits)."""
        return draw(self, **kwargs)


@dataclass(frozen=True)
class OverlapResult(Result):
    """The kept edges and nodes two circuits share.

    Attributes:
        edges_a: Kept edges of the first circuit.
        edges_b: Kept edges of the second.
        edges_shared: Kept edges of both.
        edge_jaccard: ``|A ∩ B| / |A ∪ B|`` of the kept edges (1 when both keep none).
        nodes_a: Nodes the first circuit's kept edges touch.
        nodes_b: Nodes the second's touch.
        nodes_shared: Nodes of both.
        node_jaccard: The Jaccard index of the nodes.
        shared_edges: The names of the shared edges, sorted.
        meta: Provenance.
    """

    edges_a: int
    edges_b: int
    edges_shared: int
    edge_jaccard: float
    nodes_a: int
    nodes_b: int
    nodes_shared: int
    node_jaccard: float
    shared_edges: list
    meta: dict

    # what load checks: the axes fields share and the values they may take
    _shapes = {"edges_shared": "shared", "shared_edges": "shared"}
    _legal = {"edge_jaccard": PROBABILITY, "node_jaccard": PROBABILITY, "edges_a": NON_NEGATIVE,
              "edges_b": NON_NEGATIVE, "nodes_a": NON_NEGATIVE, "nodes_b": NON_NEGATIVE,
              "nodes_shared": NON_NEGATIVE, "shared_edges": DISTINCT}

    def to_frame(self) -> pd.DataFrame:
        """Two rows, edges and nodes: the count in each circuit, shared, and the Jaccard index."""
        import pandas as pd

        return pd.DataFrame([dict(unit="edges", a=self.edges_a, b=self.edges_b, shared=self.edges_shared,
                                  jaccard=self.edge_jaccard),
                             dict(unit="nodes", a=self.nodes_a, b=self.nodes_b, shared=self.nodes_shared,
                                  jaccard=self.node_jaccard)])

    def plot(self, **kwargs) -> go.Figure:
        """Edges and nodes in the first circuit only, both, and the second only (see viz.circuits)."""
        return draw(self, **kwargs)


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



def _ablate(model, pairs, circuit: Circuit, kept_sets: torch.Tensor, ablation: str, metric, batch_cells=None,
            engine: str = "auto", max_memory: Optional[ByteSize] = None, runs: Optional[dict] = None) -> dict:
    """Per-pair metrics with the complement of each kept set ``[C, n_edges]`` ablated: ``pair
    [N, C]``, the clean run ``clean [N]`` (every edge kept) and every edge ablated ``none [N]``."""
    check_choice("ablation", ablation, ABLATIONS)
    graph = circuit.graph()
    every = torch.ones(1, circuit.n_edges)
    sets = torch.cat([1.0 - kept_sets.float(), every])  # ablated edges; the last set ablates all
    got = run_edge_sets(model, pairs, graph, sets, metric, base="clean", progress=False,
                        values="corrupt" if ablation == "resample" else "mean", batch_cells=batch_cells,
                        max_memory=max_memory, engine=engine, _runs=runs)
    return dict(pair=got["values"][:, :-1], clean=got["clean"], none=got["values"][:, -1], forwards=got["forwards"],
                engine=got["engine"])


def _fractions(got: dict, *, confidence: float = 0.95, n_boot: int = 1000, seed: int = 0,
               intervals: bool = True) -> dict:
    """Normalised faithfulness ``(m − m_empty) / (m_full − m_empty)`` of the mean metrics, each with
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
def curve_sizes(n_edges: NonNegativeInt) -> list[int]:
    """The faithfulness curve's default sizes: no edge, every power of two below ``n_edges``, every edge.

    Args:
        n_edges: The circuit's number of edges.

    Returns:
        The sizes, ascending.

    Raises:
        ConfigError: ``n_edges`` is not a non-negative int.
    """
    return sorted({0, n_edges, *[2**i for i in range(n_edges.bit_length()) if 2**i < n_edges]})


@checked
def faithfulness_curve(
    model: HookedModel,
    pairs: PromptPairs,
    circuit: Circuit,
    sizes: Optional[IndexList] = None,
    *,
    ablation: str = "resample",
    metric: Union[str, Callable, None] = None,
    batch_cells: Optional[PositiveInt] = None,
    max_memory: Optional[ByteSize] = None,
    engine: str = "auto",
    confidence: OpenUnitFloat = 0.95,
    n_boot: Bootstraps = 1000,
    seed: NonNegativeInt = 0,
) -> FaithfulnessCurveResult:
    """Faithfulness curve: the normalised metric with the top-``k`` edges by |score| kept, for
    each ``k`` in ``sizes`` (whole edge counts, each once, run and returned ascending; default 0,
    1, 2, 4, ... and every edge), the rest ablated (``"resample"``: the corrupt prompt's sender
    outputs; ``"mean"``: the clean prompts' mean). Each value has a ``confidence`` percentile
    bootstrap interval over pairs (``n_boot`` resamples of the pair index, ``seed``); the curve
    holds no fraction (NaN, with a note) when every edge and no edge are not distinguishable.
    All sizes run stacked in one batch of forwards (at most ``batch_cells`` edge sets per forward),
    pair batches and stacks sized from ``max_memory`` bytes
    (:func:`arithinterp.engine.budget.memory_budget`); ``engine`` as in
    :func:`~arithinterp.circuits.run_edge_sets` (``"hooks"``: whole forwards). ``metric`` defaults
    to the circuit's metric by name; a callable metric has to be passed again (a saved circuit
    keeps only its name).

    Args:
        model: The hooked model the circuit was scored on.
        pairs: Counterfactual pairs of its prompts.
        circuit: Scored edges, some kept.
        sizes: Edge counts to keep (whole numbers, each once); ``None``: :func:`curve_sizes`.
        ablation: What an ablated edge carries: ``"resample"`` (the corrupt prompt's sender
            output) or ``"mean"`` (the clean prompts' mean).
        metric: The metric (default: the circuit's, by name; a callable is passed again).
        batch_cells: The most edge sets per forward; ``None``: from ``max_memory``.
        max_memory: Transient bytes the runs may use (``"1GiB"`` or an int).
        engine: How the runs go (:func:`~arithinterp.circuits.run_edge_sets`).
        confidence: The intervals' level.
        n_boot: Bootstrap resamples of the pairs.
        seed: Seeds the resamples.

    Returns:
        The normalised metric per size with its interval, as a :class:`FaithfulnessCurveResult`
        (``faithfulness [size]``).
    """
    check_belongs(model, "circuits.faithfulness_curve", pairs=pairs, circuit=circuit)
    n = circuit.n_edges
    if sizes is None:
        sizes = curve_sizes(n)
    sizes = _check_sizes(sizes, n)
    order = order_by_score(circuit)
    kept = torch.zeros(len(sizes), n)
    for i, s in enumerate(sizes):
        kept[i, order[:s]] = 1.0
    got = _ablate(model, pairs, circuit, kept, ablation, metric or circuit.metric, batch_cells, engine, max_memory)
    frac = _fractions(got, confidence=confidence, n_boot=n_boot, seed=seed)
    return FaithfulnessCurveResult(
        sizes=torch.tensor(sizes), faithfulness=frac["values"], ci_low=frac["low"], ci_high=frac["high"],
        metric_circuit=frac["raw"],
        metric_full=frac["all"], metric_empty=frac["none"], n_edges=n, ablation=ablation, method=circuit.method,
        meta=build_meta(model, n_pairs=len(pairs), metric=metric_name(metric or circuit.metric),
                        forwards=got["forwards"], engine=got["engine"], confidence=confidence, n_boot=n_boot,
                        seed=seed, denominator=frac["denominator"], note=frac["note"]),
    )


@checked
def edge_faithfulness(
    model: HookedModel,
    pairs: PromptPairs,
    circuit: Circuit,
    *,
    ablation: str = "resample",
    metric: Union[str, Callable, None] = None,
    max_memory: Optional[ByteSize] = None,
    engine: str = "auto",
    confidence: OpenUnitFloat = 0.95,
    n_boot: Bootstraps = 1000,
    seed: NonNegativeInt = 0,
) -> EdgeFaithfulnessResult:
    """The normalised faithfulness of the circuit's kept edges, every other edge ablated (as
    :func:`faithfulness_curve` for one size: the kept edges, whichever they are), with its
    ``confidence`` percentile-bootstrap interval over pairs (``n_boot`` resamples, ``seed``).
    When every edge and no edge are not distinguishable the value is NaN, with a note (a fraction
    of that difference would be a fraction of noise); ``raw`` still holds the mean metric.

    Args:
        model: The hooked model the circuit was scored on.
        pairs: Counterfactual pairs of its prompts.
        circuit: Scored edges, some kept.
        ablation: What an ablated edge carries: ``"resample"`` (the corrupt prompt's sender
            output) or ``"mean"`` (the clean prompts' mean).
        metric: The metric (default: the circuit's, by name; a callable is passed again).
        max_memory: Transient bytes the runs may use (``"1GiB"`` or an int).
        engine: How the runs go (:func:`~arithinterp.circuits.run_edge_sets`).
        confidence: The interval's level.
        n_boot: Bootstrap resamples of the pairs.
        seed: Seeds the resamples.

    Returns:
        The kept edges' normalised faithfulness with its interval, as an
        :class:`EdgeFaithfulnessResult`.
    """
    check_belongs(model, "circuits.edge_faithfulness", pairs=pairs, circuit=circuit)
    got = _ablate(model, pairs, circuit, circuit.kept[None].float(), ablation, metric or circuit.metric,
                  engine=engine, max_memory=max_memory)
    frac = _fractions(got, confidence=confidence, n_boot=n_boot, seed=seed)
    return EdgeFaithfulnessResult(
        faithfulness=float(frac["values"][0]), ci_low=float(frac["low"][0]), ci_high=float(frac["high"][0]),
        metric_circuit=float(frac["raw"][0]), metric_full=frac["all"], metric_empty=frac["none"], n_kept=circuit.n_kept,
        n_edges=circuit.n_edges, ablation=ablation, method=circuit.method,
        meta=build_meta(model, n_pairs=len(pairs), metric=metric_name(metric or circuit.metric),
                        forwards=got["forwards"], engine=got["engine"], confidence=confidence, n_boot=n_boot,
                        seed=seed, denominator=frac["denominator"], note=frac["note"],
                        extraction=circuit.meta.get("extraction")),
    )


@checked
def minimality(
    model: HookedModel,
    pairs: PromptPairs,
    circuit: Circuit,
    *,
    ablation: str = "resample",
    metric: Union[str, Callable, None] = None,
    batch_cells: Optional[PositiveInt] = None,
    max_memory: Optional[ByteSize] = None,
    engine: str = "auto",
) -> MinimalityResult:
    """For each kept edge, the faithfulness lost when it alone is dropped from the circuit; all
    drops run stacked (at most ``batch_cells`` edge sets per forward). When every edge and no edge
    are not distinguishable the values are NaN, with a note (see :func:`faithfulness_curve`).

    Args:
        model: The hooked model the circuit was scored on.
        pairs: Counterfactual pairs of its prompts.
        circuit: Scored edges, some kept.
        ablation: What an ablated edge carries: ``"resample"`` (the corrupt prompt's sender
            output) or ``"mean"`` (the clean prompts' mean).
        metric: The metric (default: the circuit's, by name; a callable is passed again).
        batch_cells: The most edge sets per forward; ``None``: from ``max_memory``.
        max_memory: Transient bytes the runs may use (``"1GiB"`` or an int).
        engine: How the runs go (:func:`~arithinterp.circuits.run_edge_sets`).

    Returns:
        The faithfulness lost per kept edge, as a :class:`MinimalityResult`.

    Raises:
        AnalysisError: the circuit keeps no edge.
    """
    check_belongs(model, "circuits.minimality", pairs=pairs, circuit=circuit)
    ids = torch.nonzero(circuit.kept).flatten()
    if len(ids) == 0:
        raise AnalysisError("the circuit keeps no edges; nothing to drop")
    sets = circuit.kept[None].float().repeat(len(ids) + 1, 1)
    sets[torch.arange(len(ids)), ids] = 0.0
    got = _ablate(model, pairs, circuit, sets, ablation, metric or circuit.metric, batch_cells, engine, max_memory)
    frac = _fractions(got, intervals=False)
    values = frac["values"]
    full = float(values[-1])
    without = values[:-1]
    return MinimalityResult(
        edges=[circuit.edges[i] for i in ids.tolist()], scores=circuit.scores[ids].float(), without=without.float(),
        loss=(full - without).float(), faithfulness=full, ablation=ablation, method=circuit.method,
        meta=build_meta(model, n_pairs=len(pairs), metric=metric_name(metric or circuit.metric),
                        forwards=got["forwards"], engine=got["engine"], denominator=frac["denominator"],
                        note=frac["note"]),
    )


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

    Args:
        model: The hooked model the circuit was scored on.
        pairs: Counterfactual pairs of its prompts.
        circuit: Scored edges, some kept.
        tau: The largest faithfulness drop accepted when an edge is removed.
        ablation: What an ablated edge carries: ``"resample"`` (the corrupt prompt's sender
            output) or ``"mean"`` (the clean prompts' mean).
        metric: The metric (default: the circuit's, by name; a callable is passed again).
        engine: How the runs go (:func:`~arithinterp.circuits.run_edge_sets`).
        max_memory: Transient bytes the runs may use (``"1GiB"`` or an int).
        progress: Show a progress bar over the visited edges.

    Returns:
        The circuit with the edges that survived kept.
    """
    check_belongs(model, "circuits.prune", pairs=pairs, circuit=circuit)
    from arithinterp.progress import progress_bar

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
    for i in progress_bar(key, desc="prune", disable=not progress):
        trial = kept.clone()
        trial[i] = False
        value = value_of(trial)
        if current - value < tau:
            kept, current = trial, value
    out = circuit.with_kept(kept, f"pruned tau={tau}")
    return replace(out, meta={**out.meta, "faithfulness_before": start, "faithfulness_after": current,
                              "ablation": ablation})


@checked
def overlap(a: Circuit, b: Circuit) -> OverlapResult:
    """Shared kept edges and nodes of two circuits (e.g. of two operators or models): counts and
    Jaccard indices (|A ∩ B| / |A ∪ B|).

    Args:
        a: One circuit.
        b: The other, of a model with the same graph.

    Returns:
        The counts and Jaccard indices, as an :class:`OverlapResult`.
    """
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
    return OverlapResult(edges_a=len(ea), edges_b=len(eb), edges_shared=len(ea & eb), edge_jaccard=jac(ea, eb),
                         nodes_a=len(na), nodes_b=len(nb), nodes_shared=len(na & nb), node_jaccard=jac(na, nb),
                         shared_edges=sorted(ea & eb),
                         meta=build_meta(a_method=a.method, b_method=b.method, a_model=a.meta.get("model"),
                                         b_model=b.meta.get("model")))
