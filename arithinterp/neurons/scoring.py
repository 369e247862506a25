"""Scoring: pure, vectorised top-k scores of neuron activation maps against heuristics, their exact
cell-shuffle p-values with a false-discovery-rate correction, and the classification into a
:class:`HeuristicTable`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from arithinterp.engine.budget import chunk_for
from arithinterp.checks import integer
from arithinterp.errors import AnalysisError, ConfigError
from arithinterp.neurons.heuristics import (
    MAP_KINDS,
    HeuristicRegistry,
    check_op,
    check_registry,
    values_tensor,
    build_heuristics,
)
from arithinterp.neurons.table import HeuristicTable
from arithinterp.results import build_meta
from arithinterp.types import ByteSize, checked

SCORE_CHUNK = 128  # neurons whose tie-breaking permutations are drawn together


def _keys(values: np.ndarray, tiebreak: np.ndarray) -> np.ndarray:
    """Unique int64 sort keys [n, C]: the float's order in the high 32 bits, ``tiebreak`` (one
    permutation of 0..C-1 per row, [n, C]) in the low bits, so equal activations (ReLU zeros) are
    ordered at random and every top-k holds exactly k cells."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.int32).astype(np.int64)
    bits ^= (bits >> 63) & 0x7FFFFFFF  # negative floats: reverse their bit order
    return (bits << 32) | tiebreak


@dataclass
class _AtomPlan:
    """Heuristics that are unions of atoms (grid rows, columns, result values): one histogram of
    (atom, rank band) per neuron counts every atom's cells above every threshold at once."""

    cols: np.ndarray  # [Z] heuristic columns (into the scored predicates)
    atom_of: np.ndarray  # [C] atom of each cell
    band: np.ndarray  # [C] band of each rank: how many of the plan's distinct k are <= rank
    slots: np.ndarray  # [S] flat (atom, band) bin of each (atom, heuristic) pair, grouped by heuristic
    starts: np.ndarray  # [Z] where each heuristic's pairs start in ``slots``
    n_atoms: int
    n_bands: int  # the plan's distinct k + 1


@dataclass
class _SegmentPlan:
    """Any other heuristics: gather each heuristic's cells, compare with its threshold, sum."""

    cols: np.ndarray  # [G] heuristic columns
    cells: np.ndarray  # [nnz] the cells of every heuristic, heuristic after heuristic
    which: np.ndarray  # [nnz] threshold index of each entry's heuristic
    starts: np.ndarray  # [G] where each heuristic's cells start


def _atom_plan(pred: torch.Tensor, counts: np.ndarray, atoms: torch.Tensor, cols: torch.Tensor) -> _AtomPlan:
    T, C = int(atoms.max()) + 1, atoms.numel()
    member = torch.zeros(T, len(cols)).index_add_(0, atoms, pred[:, cols].float()) > 0
    t_idx, h_idx = (x.numpy() for x in torch.nonzero(member.T, as_tuple=True)[::-1])  # grouped by heuristic
    ks, local = np.unique(counts[cols.numpy()], return_inverse=True)
    band = np.searchsorted(ks, np.arange(C), side="right")
    J = len(ks)
    sizes = np.bincount(h_idx, minlength=len(cols))
    return _AtomPlan(
        cols=cols.numpy(), atom_of=atoms.numpy().astype(np.int64), band=band.astype(np.int64),
        slots=t_idx * (J + 1) + local[h_idx], starts=np.cumsum(sizes) - sizes, n_atoms=T, n_bands=J + 1,
    )


def _segment_plan(pred: torch.Tensor, kindex: np.ndarray, cols: torch.Tensor) -> _SegmentPlan:
    """``kindex[h]``: which distinct k (threshold column) heuristic h uses."""
    sub = pred[:, cols].T.numpy()  # [G, C]
    h_idx, cells = np.nonzero(sub)
    sizes = sub.sum(1)
    return _SegmentPlan(cols.numpy(), cells, kindex[cols.numpy()][h_idx], np.concatenate([[0], np.cumsum(sizes)[:-1]]))


def _constant_on(pred: torch.Tensor, atoms: torch.Tensor) -> torch.Tensor:
    """Which predicate columns are constant on every atom: [H] bool."""
    T = int(atoms.max()) + 1
    sizes = torch.bincount(atoms, minlength=T).float()
    inside = torch.zeros(T, pred.shape[1]).index_add_(0, atoms, pred.float())
    return ((inside == 0) | (inside == sizes[:, None])).all(0)


def _plans(pred: torch.Tensor, counts: np.ndarray, kindex: np.ndarray, atom_labelings: Sequence[torch.Tensor]) -> list:
    """Atom plans for the heuristics that are unions of few atoms, a segment plan for the rest."""
    remaining = torch.arange(pred.shape[1])
    plans: list = []
    C = pred.shape[0]
    for atoms in atom_labelings:
        if remaining.numel() == 0:
            break
        if int(atoms.max()) + 1 > C // 4:  # many atoms: no cheaper than gathering the cells
            continue
        fits = _constant_on(pred[:, remaining], atoms)
        if fits.any():
            plans.append(_atom_plan(pred, counts, atoms, remaining[fits]))
            remaining = remaining[~fits]
    if remaining.numel():
        plans.append(_segment_plan(pred, kindex, remaining))
    return plans


def _hits(
    cells: np.ndarray, keys: np.ndarray, thresholds: np.ndarray, plans, n_heuristics: int, top: bool
) -> np.ndarray:
    """Cells of each heuristic inside its top-k (``top``) or bottom-k, per row: [n, H].

    ``cells[:, i]`` is the cell at descending rank i; ``thresholds[:, j]`` the key of the k_j-th
    largest (or smallest) cell. Keys are unique, so a cell is in the top-k exactly when its key is
    >= that threshold (<= for the bottom-k), and exactly when its rank is < k.
    """
    n, C = keys.shape
    out = np.zeros((n, n_heuristics), np.float32)
    for plan in plans:
        if isinstance(plan, _AtomPlan):
            band = plan.band if top else plan.band[::-1]  # bottom-k: ranks counted from the end
            bins = plan.n_atoms * plan.n_bands
            code = plan.atom_of[cells] * plan.n_bands + band[None]
            code += (np.arange(n, dtype=np.int64) * bins)[:, None]
            hist = np.bincount(code.ravel(), minlength=n * bins).reshape(n, plan.n_atoms, plan.n_bands)
            below = np.cumsum(hist, axis=2).reshape(n, bins)  # [n, atom x band]: cells ranked < k
            out[:, plan.cols] = np.add.reduceat(below[:, plan.slots], plan.starts, axis=1)
        else:
            values = keys[:, plan.cells]
            limits = thresholds[:, plan.which]
            hit = (values >= limits) if top else (values <= limits)
            out[:, plan.cols] = np.add.reduceat(hit, plan.starts, axis=1, dtype=np.int32)
    return out


@checked
def score_maps(
    maps: torch.Tensor,
    predicates: torch.Tensor,
    *,
    atoms: Sequence[torch.Tensor] = (),
    bottom: bool = False,
    seed: int = 0,
    chunk_size: int = SCORE_CHUNK,
    progress: bool = False,
    shuffle: bool = False,
    offset: int = 0,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Heuristic scores of every neuron map (Nikankin et al. 2025, "Arithmetic Without Algorithms").

    The score of heuristic h for a neuron is the fraction of the neuron's top-k cells that satisfy
    h, with k = the number of cells satisfying h. Ties between equal activations (ReLU zeros) are
    broken by a seeded random permutation of the cells drawn for each neuron, so no region of the
    grid is favoured and no two neurons share a tie order (with one shared order, every sparse
    neuron would fill its top-k with the same zero cells).

    How: each row is sorted once (keys made unique by the tie-breaker), which gives the threshold
    of every distinct k; a cell is in a top-k exactly when its key reaches that threshold. The
    heuristics that are unions of ``atoms`` (grid rows, columns or result values) are then
    counted with one histogram per neuron over (atom, rank band) whose cumulative sums give each
    atom's cells inside each top-k; the rest by gathering each heuristic's cells and comparing
    with its threshold — never a pass per heuristic over the grid.

    Args:
        maps: ``[N, C]`` activations of N neurons over the C legal cells.
        predicates: ``[C, H]`` bool, which cells satisfy each heuristic.
        atoms: optional labelings ``[C]`` of the cells (e.g. the a, b or result index of each).
        bottom: also score the bottom-k (gated MLPs, whose neurons act through negative values).
        seed: the tie-breaking permutations (drawn per chunk of ``chunk_size`` neurons from
            ``seed`` and the chunk's start, so the same call gives the same scores).
        offset: the index of ``maps``' first row among all the neurons scored (a multiple of
            ``chunk_size``): maps scored in parts get the permutations of one call on all of them.
        shuffle: score cell-shuffled maps instead: each neuron's values are permuted over the C
            cells by its own seeded permutation (the null of Nikankin-style labels: same values,
            no grid structure).

    Returns:
        ``(top, bottom)`` scores, ``[N, H]`` float each (``bottom`` is ``None`` unless asked).
    """
    if maps.ndim != 2 or predicates.ndim != 2 or maps.shape[1] != predicates.shape[0]:
        raise AnalysisError(
            f"maps must be [N, C] and predicates [C, H] with the same C; "
            f"got {tuple(maps.shape)} and {tuple(predicates.shape)}"
        )
    N, C = maps.shape
    predicates = predicates.bool()
    counts = predicates.sum(0)
    if (counts == 0).any():
        raise AnalysisError("every heuristic needs at least one cell; drop empty predicate columns")
    distinct, kindex = np.unique(counts.numpy(), return_inverse=True)
    plans = _plans(predicates, counts.numpy(), kindex, [a.long() for a in atoms])
    H = predicates.shape[1]
    scale = counts.numpy().astype(np.float32)
    top = torch.empty(N, H)
    low = torch.empty(N, H) if bottom else None
    starts = range(0, N, chunk_size)
    for start in tqdm(starts, desc="score heuristics", disable=not progress or len(starts) < 2):
        rng = np.random.default_rng([seed, offset + start, int(shuffle)])
        values = maps[start : start + chunk_size].float().numpy()
        n = values.shape[0]
        if shuffle:
            values = rng.permuted(values, axis=1)
        tiebreak = rng.permuted(np.tile(np.arange(C, dtype=np.int64), (n, 1)), axis=1)
        cell_of = np.empty_like(tiebreak)  # per row: tie-breaker value -> cell
        np.put_along_axis(cell_of, tiebreak, np.arange(C, dtype=np.int64)[None].repeat(n, 0), axis=1)
        keys = _keys(values, tiebreak)
        ordered = np.sort(keys, axis=1)
        cells = np.take_along_axis(cell_of, ordered[:, ::-1] & 0xFFFFFFFF, axis=1)  # cells by descending rank
        top[start : start + chunk_size] = torch.from_numpy(
            _hits(cells, keys, ordered[:, C - distinct], plans, H, True) / scale)
        if low is not None:  # bottom
            low[start : start + chunk_size] = torch.from_numpy(
                _hits(cells, keys, ordered[:, distinct - 1], plans, H, False) / scale)
    return top, low


def check_threshold(threshold: float) -> float:
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold <= 1:
        raise ConfigError(f"threshold must be a number in (0, 1], got {threshold!r}")
    return float(threshold)


def _check_fdr(fdr: Optional[float]) -> Optional[float]:
    if fdr is None:
        return None
    if isinstance(fdr, bool) or not isinstance(fdr, (int, float)) or not 0 < fdr < 1:
        raise ConfigError(f"fdr must be a number in (0, 1) (e.g. 0.05) or None for the threshold alone, got {fdr!r}")
    return float(fdr)


@checked
def shuffle_p_values(hits: np.ndarray, counts: np.ndarray, n_cells: int) -> np.ndarray:
    """Exact p-values of top-k hit counts under cell shuffling.

    When a neuron's values are permuted over the ``n_cells`` legal cells (ties broken at random),
    its top-k cells are a uniformly random k-subset, so the number of them that satisfy a
    heuristic holding k cells is hypergeometric (population ``n_cells``, k successes, k draws)
    whatever the neuron's values are: this *is* the score distribution of that neuron's
    cell-shuffled maps, with no sampling error and tails far below any Monte-Carlo resolution.

    Args:
        hits: ``[N, H]`` integers, top-k cells that satisfy each heuristic (score × k).
        counts: ``[H]`` the k of each heuristic.
        n_cells: the number of legal cells C.

    Returns:
        ``[N, H]`` float64, P(X ≥ hits) for X ~ Hypergeometric(C, k, k).
    """
    hits = np.asarray(hits, dtype=np.int64)
    counts = np.asarray(counts, dtype=np.int64)
    if hits.ndim != 2 or counts.shape != (hits.shape[1],):
        raise AnalysisError(f"hits must be [N, H] and counts [H]; got {hits.shape} and {counts.shape}")
    if ((hits < 0) | (hits > counts[None])).any() or (counts > n_cells).any():
        raise AnalysisError("hits must lie in 0..k and every k in 1..n_cells")
    out = np.empty(hits.shape, dtype=np.float64)
    for k in np.unique(counts).tolist():  # one tail per distinct k (a few hundred), never per neuron
        cols = np.flatnonzero(counts == k)
        out[:, cols] = _hypergeometric_tail(int(k), int(n_cells))[hits[:, cols]]
    return out


def _log_comb(n: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    inside = (r >= 0) & (r <= n)
    value = torch.lgamma(n + 1) - torch.lgamma(r.clamp(min=0) + 1) - torch.lgamma((n - r).clamp(min=0) + 1)
    return torch.where(inside, value, torch.full_like(value, -math.inf))


def _hypergeometric_tail(k: int, n_cells: int) -> np.ndarray:
    """``[k + 1]``: P(X ≥ x) for x = 0..k, X ~ Hypergeometric(n_cells, k successes, k draws)."""
    x = torch.arange(k + 1, dtype=torch.float64)
    n, kk = torch.tensor(float(n_cells), dtype=torch.float64), torch.tensor(float(k), dtype=torch.float64)
    log_pmf = _log_comb(kk, x) + _log_comb(n - kk, kk - x) - _log_comb(n, kk)
    tail = torch.logcumsumexp(log_pmf.flip(0), 0).flip(0).exp()  # log space: tails far below 1e-300 stay exact
    return tail.clamp(max=1.0).numpy()


@checked
def benjamini_hochberg(p_values: np.ndarray) -> np.ndarray:
    """Benjamini–Hochberg adjusted p-values (q-values) of any-shaped ``p_values``, one family.

    NaN entries are not tests (they keep NaN). A test is a discovery at false-discovery rate q
    when its adjusted value is ≤ q (Benjamini & Hochberg 1995).
    """
    p = np.asarray(p_values, dtype=np.float64)
    flat = p.ravel()
    tested = np.flatnonzero(~np.isnan(flat))
    out = np.full(flat.shape, np.nan)
    m = tested.size
    if m == 0:
        return out.reshape(p.shape)
    order = tested[np.argsort(flat[tested], kind="stable")]
    scaled = flat[order] * m / np.arange(1, m + 1)
    out[order] = np.minimum(np.minimum.accumulate(scaled[::-1])[::-1], 1.0)
    return out.reshape(p.shape)


class _RunningFDR:
    """Benjamini–Hochberg over p-values that arrive in chunks, in memory of their distinct values.

    The adjusted value of a p-value depends only on the value (tied p-values share it), so the
    counts of each distinct value give exactly :func:`benjamini_hochberg`'s q-values; the p-values
    here (hypergeometric tails) take few distinct values.
    """

    def __init__(self) -> None:
        self.values = np.empty(0)
        self.counts = np.empty(0, dtype=np.int64)
        self._q: Optional[np.ndarray] = None

    def add(self, p: np.ndarray) -> None:
        p = np.asarray(p, dtype=np.float64).ravel()
        values, counts = np.unique(p[~np.isnan(p)], return_counts=True)
        merged, inverse = np.unique(np.concatenate([self.values, values]), return_inverse=True)
        self.counts = np.bincount(inverse, weights=np.concatenate([self.counts, counts]),
                                  minlength=len(merged)).astype(np.int64)
        self.values, self._q = merged, None

    def q_of_values(self) -> np.ndarray:
        """The q-value of each distinct p-value (ascending)."""
        if self._q is None:
            m = int(self.counts.sum())
            last_rank = np.cumsum(self.counts).astype(np.float64)  # the tie group's last rank
            scaled = self.values * m / last_rank
            self._q = np.minimum(np.minimum.accumulate(scaled[::-1])[::-1], 1.0)
        return self._q

    def q(self, p: np.ndarray) -> np.ndarray:
        """q-values of p-values that were added (NaN stays NaN)."""
        p = np.asarray(p, dtype=np.float64)
        out = np.full(p.shape, np.nan)
        tested = ~np.isnan(p)
        if len(self.values):
            out[tested] = self.q_of_values()[np.searchsorted(self.values, p[tested])]
        return out

    def largest_discovery(self, fdr: float) -> float:
        """The largest p-value whose q-value is ≤ ``fdr`` (−inf if none): q grows with p, so the
        discoveries are exactly the p-values up to it."""
        hit = np.flatnonzero(self.q_of_values() <= fdr)
        return float(self.values[hit[-1]]) if len(hit) else -math.inf


class _RunningNullSummary:
    """What cell-shuffled maps get, from chunks of them: how many neurons are labelled, by the
    threshold alone and under the stated control, and quantiles of each neuron's best score. Per
    neuron it keeps its best score and the smallest p-value among its heuristics over the
    threshold; of all tests, and of those over the threshold, the distinct p-values' counts."""

    def __init__(self, n: int, threshold: float, fdr: Optional[float]):
        self.threshold, self.fdr = threshold, fdr
        self.top = torch.empty(n, dtype=torch.float64)
        self.over_any = torch.zeros(n, dtype=torch.bool)
        self.min_p_over = torch.full((n,), math.inf, dtype=torch.float64)
        self.all_p, self.over_p = _RunningFDR(), _RunningFDR()
        self.n_over = 0

    def add(self, start: int, best: torch.Tensor, p: np.ndarray) -> None:
        stop = start + best.shape[0]
        over = (best >= self.threshold).numpy()
        self.top[start:stop] = best.nan_to_num(-1.0).max(1).values.double()
        self.over_any[start:stop] = torch.from_numpy(over.any(1))
        self.min_p_over[start:stop] = torch.from_numpy(np.where(over, p, np.inf).min(1))
        self.all_p.add(p)
        self.over_p.add(p[over])
        self.n_over += int(over.sum())

    def summary(self) -> dict:
        N = self.top.shape[0]
        if self.fdr is None:
            labelled_any, labels = self.over_any, self.n_over
        else:
            cut = self.all_p.largest_discovery(self.fdr)
            labelled_any = self.min_p_over <= cut
            labels = int(self.over_p.counts[self.over_p.values <= cut].sum())
        quantiles = torch.quantile(self.top, torch.tensor([0.5, 0.95, 0.99], dtype=torch.float64)).tolist()
        return dict(
            neurons=N,
            labelled_by_threshold=int(self.over_any.sum()),
            labelled=int(labelled_any.sum()),
            fraction_labelled=float(labelled_any.float().mean()),
            labels=labels,
            best_score_median=quantiles[0], best_score_q95=quantiles[1], best_score_q99=quantiles[2],
            best_score_max=float(self.top.max()),
        )


def _p_values(top: torch.Tensor, low: Optional[torch.Tensor], counts: torch.Tensor, n_cells: int) -> torch.Tensor:
    """Cell-shuffle p-values [N, H] of the deciding score: the top-k, or with ``low`` the better
    of the two sides (Bonferroni over the two: 2 × the smaller p)."""
    k = counts.numpy().astype(np.int64)
    scored = ~torch.isnan(top[0]).numpy() if top.shape[0] else np.zeros(len(k), bool)
    out = np.full(tuple(top.shape), np.nan)
    if scored.any():
        def side(scores: torch.Tensor) -> np.ndarray:
            hits = np.rint(scores.numpy()[:, scored].astype(np.float64) * k[scored]).astype(np.int64)
            return shuffle_p_values(hits, k[scored], n_cells)

        p = side(top)
        if low is not None and low.numel():
            p = np.minimum(1.0, 2 * np.minimum(p, side(low)))
        out[:, scored] = p
    return torch.from_numpy(out)


def _score_all(maps_by_kind, heuristics, atoms, bottom, seed, chunk_size, progress, shuffle=False, offset=0):
    """Top (and bottom) scores [N, H] of the K / KV maps on their heuristics; NaN where unscored."""
    flat = heuristics.legal.flatten()
    N = next(m.shape[0] for m in maps_by_kind.values() if m is not None)
    H = len(heuristics.heuristics)
    scores = torch.full((N, H), float("nan"))
    bottom_scores = torch.full((N, H), float("nan")) if bottom else torch.empty(0)
    for kind, m in maps_by_kind.items():
        cols = heuristics.kind(kind)
        if m is None or cols.numel() == 0:
            continue
        top, low = score_maps(
            m.reshape(N, -1)[:, flat].float(), heuristics.predicates[:, cols],
            atoms=atoms[kind], bottom=bottom, seed=seed, chunk_size=chunk_size, progress=progress, shuffle=shuffle,
            offset=offset,
        )
        scores[:, cols] = top
        if low is not None:  # bottom
            bottom_scores[:, cols] = low
    return scores, bottom_scores


@checked
def classify_maps(
    k_maps: Optional[torch.Tensor],
    kv_maps: Optional[torch.Tensor],
    a_values: Iterable[int],
    b_values: Iterable[int],
    op: str,
    threshold: float = 0.6,
    *,
    fdr: Optional[float] = 0.05,
    shuffle_control: bool = True,
    registry: Optional[HeuristicRegistry] = None,
    modulus: Optional[int] = None,
    families: Optional[Sequence[str]] = None,
    bottom: bool = False,
    min_cells: int = 3,
    max_fraction: float = 0.5,
    layers: Optional[torch.Tensor] = None,
    neurons: Optional[torch.Tensor] = None,
    importance: Optional[torch.Tensor] = None,
    seed: int = 0,
    chunk_size: int = SCORE_CHUNK,
    max_memory: Optional[ByteSize] = None,
    progress: bool = False,
    meta: Optional[dict] = None,
) -> "HeuristicTable":
    """Label neurons with the heuristics their maps implement (pure; Nikankin et al. 2025).

    A neuron implements heuristic h when (1) its score reaches ``threshold`` (the paper's 0.6,
    kept as an effect-size floor) and (2) the score beats the score distribution of the neuron's
    own cell-shuffled maps at false-discovery rate ``fdr``: the exact cell-shuffle p-value
    (:func:`shuffle_p_values`) is adjusted by Benjamini–Hochberg over all neurons × heuristics of
    the table (``q_values``). Without (2), noise maps of a ten-by-ten grid get a label on about a
    fifth of their neurons at 0.6 (many heuristics, few cells each).

    With ``shuffle_control`` the same classification is also run on one cell-shuffled copy of
    every neuron's maps (a seeded permutation per neuron) and ``meta["control"]`` states what it
    found: how many null neurons the threshold alone labels, how many the full rule labels, and
    quantiles of their best scores, next to the rule (null, test, FDR, number of tests).

    Args:
        k_maps: ``[N, A, B]`` activations over the grid (operand heuristics), or ``None``.
        kv_maps: ``[N, A, B]`` activation × logit-lens value (result heuristics), or ``None``.
            NaN marks a missing cell (a prompt left out); a cell missing for any neuron, or where
            the operator is undefined, is illegal for all.
        a_values: the first operand's values along axis 1.
        b_values: the second operand's values along axis 2.
        op: the task's operator (:data:`OPS`); result heuristics use its results.
        modulus: results are reduced mod ``modulus`` (``None``: not reduced).
        threshold: a neuron implements a heuristic when its score reaches this, in (0, 1].
        fdr: false-discovery rate in (0, 1) for the shuffle test (``None``: the threshold alone,
            as in the paper).
        shuffle_control: also classify cell-shuffled maps and report the result in ``meta``.
        registry: the :class:`HeuristicRegistry` to score (default: the built-in families).
        families: heuristic families of ``registry`` to score (default all that apply to ``op``).
        bottom: also score the bottom-k and keep the better side (gated MLPs).
        min_cells: see :func:`build_heuristics`.
        max_fraction: see :func:`build_heuristics`.
        layers: ``[N]`` model layer of each map (default 0).
        neurons: ``[N]`` neuron index of each map (default 0..N-1).
        importance: ``[N]`` importance scores kept in the table.
        seed: tie-breaking permutations and the control's cell shuffles.
        max_memory: bytes the scoring may use at once on top of the maps and the table (neurons
            are scored in chunks of ``chunk_size`` multiples; ``None``: all at once). The table is
            the same whatever the chunking.
    """
    check_threshold(threshold)
    _check_fdr(fdr)
    check_op(op, modulus)
    given = {name: m for name, m in (("k_maps", k_maps), ("kv_maps", kv_maps)) if m is not None}
    if not given:
        raise AnalysisError("give k_maps, kv_maps or both")
    a_vals, b_vals = values_tensor("a_values", a_values), values_tensor("b_values", b_values)
    shape: Optional[torch.Size] = None
    for name, m in given.items():
        if not isinstance(m, torch.Tensor) or m.ndim != 3 or m.shape[1:] != (len(a_vals), len(b_vals)):
            got = tuple(m.shape) if isinstance(m, torch.Tensor) else type(m).__name__
            raise AnalysisError(
                f"{name} must be a tensor [neurons, len(a_values), len(b_values)] = "
                f"[N, {len(a_vals)}, {len(b_vals)}], got {got}"
            )
        if shape is not None and m.shape != shape:
            raise AnalysisError(
                f"k_maps and kv_maps must have the same shape, got {tuple(shape)} and {tuple(m.shape)}")
        shape = m.shape
    assert shape is not None  # given holds at least one map
    finite = torch.ones(shape[1:], dtype=torch.bool)
    for m in given.values():
        finite &= torch.isfinite(m).all(0)

    def source(start: int, stop: int):
        return (None if k_maps is None else k_maps[start:stop], None if kv_maps is None else kv_maps[start:stop])

    return classify_stream(
        source, shape[0], a_vals.tolist(), b_vals.tolist(), op, threshold, legal=finite, kinds=tuple(
            kind for kind, m in (("K", k_maps), ("KV", kv_maps)) if m is not None),
        fdr=fdr, shuffle_control=shuffle_control, registry=registry, modulus=modulus, families=families,
        bottom=bottom, min_cells=min_cells, max_fraction=max_fraction, layers=layers, neurons=neurons,
        importance=importance, seed=seed, chunk_size=chunk_size, max_memory=max_memory, progress=progress, meta=meta,
    )


MapSource = Callable[[int, int], tuple[Optional[torch.Tensor], Optional[torch.Tensor]]]


def check_chunk_size(chunk_size: int) -> int:
    return integer("chunk_size", chunk_size, minimum=1, hint=" (neurons scored together)")


def rows_per_chunk(n_cells: int, n_legal: int, n_heuristics: int, chunk_size: int, max_memory: Optional[ByteSize],
                   n_rows: int, share: float = 1.0) -> int:
    """Neurons scored per chunk: a multiple of ``chunk_size`` (so the seeded tie-breaks are the
    same whatever the chunking) whose maps and scores fit in ``share`` of ``max_memory`` bytes."""
    if max_memory is None:
        return max(n_rows, 1)
    # per neuron: K and KV maps (and their float copies), the sort keys and cell orders (int64),
    # and the top / bottom / null scores and p-values of every heuristic
    per_row = 4 * 4 * n_cells + 8 * 6 * n_legal + 4 * 12 * n_heuristics
    units = chunk_for(int(max_memory), per_row * chunk_size, f"chunk of {chunk_size} neurons' maps and scores",
                      share=share)
    return units * chunk_size


def classify_stream(
    source: MapSource,
    n_neurons: int,
    a_values: Iterable[int],
    b_values: Iterable[int],
    op: str,
    threshold: float = 0.6,
    *,
    legal: torch.Tensor,
    kinds: Sequence[str] = MAP_KINDS,
    fdr: Optional[float] = 0.05,
    shuffle_control: bool = True,
    registry: Optional[HeuristicRegistry] = None,
    modulus: Optional[int] = None,
    families: Optional[Sequence[str]] = None,
    bottom: bool = False,
    min_cells: int = 3,
    max_fraction: float = 0.5,
    layers: Optional[torch.Tensor] = None,
    neurons: Optional[torch.Tensor] = None,
    importance: Optional[torch.Tensor] = None,
    seed: int = 0,
    chunk_size: int = SCORE_CHUNK,
    max_memory: Optional[ByteSize] = None,
    memory_share: float = 1.0,
    progress: bool = False,
    meta: Optional[dict] = None,
) -> "HeuristicTable":
    """:func:`classify_maps` over neurons whose maps come in chunks: ``source(start, stop)`` gives
    ``(k_maps, kv_maps)`` ``[stop - start, A, B]`` of rows ``start:stop`` (``None`` for a kind not in
    ``kinds``); ``legal`` ``[A, B]`` marks the cells to score. Only the table's
    ``[neurons, heuristics]`` scores are kept; the false-discovery correction runs over all of them
    at the end, so the table equals the one of all maps at once. The chunks hold ``memory_share``
    of ``max_memory`` bytes (``None``: one chunk)."""
    threshold = check_threshold(threshold)
    fdr = _check_fdr(fdr)
    check_op(op, modulus)
    chunk_size = check_chunk_size(chunk_size)
    a_vals, b_vals = values_tensor("a_values", a_values), values_tensor("b_values", b_values)
    N = int(n_neurons)
    if N == 0:
        raise AnalysisError("no neuron maps given (N = 0)")
    registry = check_registry(registry)
    heuristics = build_heuristics(a_vals, b_vals, op, modulus=modulus, legal=legal, families=families,
                                  min_cells=min_cells, max_fraction=max_fraction, registry=registry)
    flat = heuristics.legal.flatten()
    n_legal = int(flat.sum())
    grid = heuristics.grid
    atoms = {
        "K": [_dense_ids(grid.a), _dense_ids(grid.b)],
        "KV": [_dense_ids(grid.result)],
    }
    layer_t = torch.zeros(N, dtype=torch.long) if layers is None else torch.as_tensor(layers).long()
    neuron_t = torch.arange(N) if neurons is None else torch.as_tensor(neurons).long()
    imp = torch.full((N,), float("nan")) if importance is None else torch.as_tensor(importance).float()
    for name, t in (("layers", layer_t), ("neurons", neuron_t), ("importance", imp)):
        if t.shape != (N,):
            raise AnalysisError(f"{name} must have one entry per map ([{N}]), got shape {tuple(t.shape)}")
    # the heuristics of the kinds given are scored; the others leave the table
    keep = torch.tensor([i for i, h in enumerate(heuristics.heuristics) if h.map_kind in kinds], dtype=torch.long)
    counts = heuristics.counts[keep]
    K = len(keep)
    rows = rows_per_chunk(int(flat.numel()), n_legal, len(heuristics.heuristics), chunk_size, max_memory, N,
                          memory_share)
    scores = torch.empty(N, K)
    bottom_scores = torch.empty(N, K) if bottom else torch.empty(0)
    p_values = np.empty((N, K))  # float64 until the q-values are looked up
    fdr_p = _RunningFDR()
    null = _RunningNullSummary(N, threshold, fdr) if shuffle_control else None
    starts = range(0, N, rows)
    for start in tqdm(starts, desc="classify neurons", disable=not progress or len(starts) < 2):
        stop = min(start + rows, N)
        k_chunk, kv_chunk = source(start, stop)
        by_kind = {"K": k_chunk if "K" in kinds else None, "KV": kv_chunk if "KV" in kinds else None}
        top, low = _score_all(by_kind, heuristics, atoms, bottom, seed, chunk_size, False, offset=start)
        top, low = top[:, keep], (low[:, keep] if bottom else None)
        scores[start:stop] = top
        if low is not None:
            bottom_scores[start:stop] = low
        p_values[start:stop] = _p_values(top, low, counts, n_legal).numpy()
        fdr_p.add(p_values[start:stop])
        if null is not None:  # shuffle_control
            n_top, n_low = _score_all(by_kind, heuristics, atoms, bottom, seed, chunk_size, False, shuffle=True,
                                      offset=start)
            n_top, n_low = n_top[:, keep], (n_low[:, keep] if bottom else None)
            null.add(start, _best(n_top, n_low, bottom) if n_low is not None else n_top,
                     _p_values(n_top, n_low, counts, n_legal).numpy())
    # Benjamini–Hochberg over every neuron x heuristic, looked up a chunk at a time
    q_values = torch.empty(N, K)
    p_table = torch.empty(N, K)
    for start in range(0, N, rows):
        q_values[start:start + rows] = torch.from_numpy(fdr_p.q(p_values[start:start + rows]))
        p_table[start:start + rows] = torch.from_numpy(p_values[start:start + rows])
    del p_values
    control: dict[str, Any] = dict(
        null="cell-shuffled maps: each neuron's values permuted over the legal cells",
        test="exact hypergeometric tail of the top-k hits (the cell-shuffle distribution of the score)"
        + ("; bottom-k: 2 x the better side's p" if bottom else ""),
        correction="Benjamini-Hochberg over neurons x heuristics" if fdr is not None else "none (threshold only)",
        fdr=fdr, threshold=threshold, n_tests=int(N * K),
        labelled_by_threshold=int((_best(scores, bottom_scores, bottom) >= threshold).any(1).sum()),
    )
    if null is not None:  # shuffle_control
        control["shuffled"] = null.summary()
    extra = dict(meta or {})
    extra.update(n_legal_cells=n_legal, n_cells=int(flat.numel()), dropped_heuristics=heuristics.dropped, seed=seed,
                 control=control)
    return HeuristicTable(
        layer=layer_t,
        neuron=neuron_t,
        names=[heuristics.names[i] for i in keep.tolist()],
        families=[heuristics.families[i] for i in keep.tolist()],
        map_kinds=[heuristics.map_kinds[i] for i in keep.tolist()],
        scores=scores,
        bottom_scores=bottom_scores,
        importance=imp,
        threshold=threshold,
        op=op,
        modulus=modulus,
        a_values=a_vals.tolist(),
        b_values=b_vals.tolist(),
        legal=heuristics.legal,
        meta={**build_meta(), **extra},
        p_values=p_table,
        q_values=q_values,
        fdr=fdr,
        registry=registry,
    )


def _best(top: torch.Tensor, low: torch.Tensor, bottom: bool) -> torch.Tensor:
    return torch.maximum(top, low) if bottom else top


def _dense_ids(values: torch.Tensor) -> torch.Tensor:
    return torch.unique(values, return_inverse=True)[1]
