"""Scoring: pure, vectorised top-k scores of neuron activation maps against heuristics, and their
classification into a :class:`HeuristicTable`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

import numpy as np
import torch
from tqdm.auto import tqdm

from arithinterp.errors import AnalysisError, ConfigError
from arithinterp.neurons.heuristics import _check_op, _values_tensor, build_heuristics
from arithinterp.neurons.table import HeuristicTable
from arithinterp.results import build_meta


def _keys(values: torch.Tensor, tiebreak: np.ndarray) -> np.ndarray:
    """Unique int64 sort keys [n, C]: the float's order in the high 32 bits, ``tiebreak`` (a
    permutation of 0..C-1) in the low bits, so equal activations (ReLU zeros) are ordered at
    random and every top-k holds exactly k cells."""
    bits = values.float().contiguous().numpy().view(np.int32).astype(np.int64)
    bits ^= (bits >> 63) & 0x7FFFFFFF  # negative floats: reverse their bit order
    return (bits << 32) | tiebreak[None]


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


def _hits(cells: np.ndarray, keys: np.ndarray, thresholds: np.ndarray, plans, n_heuristics: int, top: bool) -> np.ndarray:
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


def score_maps(
    maps: torch.Tensor,
    predicates: torch.Tensor,
    *,
    atoms: Sequence[torch.Tensor] = (),
    bottom: bool = False,
    seed: int = 0,
    chunk_size: int = 128,
    progress: bool = False,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Heuristic scores of every neuron map (RECIPES §4).

    The score of heuristic h for a neuron is the fraction of the neuron's top-k cells that satisfy
    h, with k = the number of cells satisfying h. Ties between equal activations (ReLU zeros) are
    broken by one seeded random permutation of the cells, so no region of the grid is favoured.

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
        seed: the tie-breaking permutation.

    Returns:
        ``(top, bottom)`` scores, ``[N, H]`` float each (``bottom`` is ``None`` unless asked).
    """
    if maps.ndim != 2 or predicates.ndim != 2 or maps.shape[1] != predicates.shape[0]:
        raise AnalysisError(
            f"maps must be [N, C] and predicates [C, H] with the same C; got {tuple(maps.shape)} and {tuple(predicates.shape)}"
        )
    N, C = maps.shape
    predicates = predicates.bool()
    counts = predicates.sum(0)
    if (counts == 0).any():
        raise AnalysisError("every heuristic needs at least one cell; drop empty predicate columns")
    distinct, kindex = np.unique(counts.numpy(), return_inverse=True)
    tiebreak = torch.randperm(C, generator=torch.Generator().manual_seed(seed)).numpy().astype(np.int64)
    cell_of = np.argsort(tiebreak)  # tie-breaker value -> cell
    plans = _plans(predicates, counts.numpy(), kindex, [a.long() for a in atoms])
    H = predicates.shape[1]
    scale = counts.numpy().astype(np.float32)
    top = torch.empty(N, H)
    low = torch.empty(N, H) if bottom else None
    starts = range(0, N, chunk_size)
    for start in tqdm(starts, desc="score heuristics", disable=not progress or len(starts) < 2):
        keys = _keys(maps[start : start + chunk_size], tiebreak)
        ordered = np.sort(keys, axis=1)
        cells = cell_of[ordered[:, ::-1] & 0xFFFFFFFF]  # cells by descending rank
        top[start : start + chunk_size] = torch.from_numpy(_hits(cells, keys, ordered[:, C - distinct], plans, H, True) / scale)
        if bottom:
            low[start : start + chunk_size] = torch.from_numpy(_hits(cells, keys, ordered[:, distinct - 1], plans, H, False) / scale)
    return top, low


def _check_threshold(threshold: float) -> float:
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold <= 1:
        raise ConfigError(f"threshold must be a number in (0, 1], got {threshold!r}")
    return float(threshold)


def classify_maps(
    k_maps: Optional[torch.Tensor],
    kv_maps: Optional[torch.Tensor],
    a_values: Iterable[int],
    b_values: Iterable[int],
    op: str,
    threshold: float = 0.6,
    *,
    modulus: Optional[int] = None,
    families: Optional[Sequence[str]] = None,
    bottom: bool = False,
    min_cells: int = 3,
    max_fraction: float = 0.5,
    layers: Optional[torch.Tensor] = None,
    neurons: Optional[torch.Tensor] = None,
    importance: Optional[torch.Tensor] = None,
    seed: int = 0,
    chunk_size: int = 128,
    progress: bool = False,
    meta: Optional[dict] = None,
) -> "HeuristicTable":
    """Label neurons with the heuristics their maps implement (pure; RECIPES §4).

    Args:
        k_maps: ``[N, A, B]`` activations over the grid (operand heuristics), or ``None``.
        kv_maps: ``[N, A, B]`` activation × logit-lens value (result heuristics), or ``None``.
            NaN marks a missing cell (a prompt left out); a cell missing for any neuron, or where
            the operator is undefined, is illegal for all.
        a_values, b_values: the operand values along axes 1 and 2.
        op, modulus: the task's operator (:data:`OPS`); result heuristics use its results.
        threshold: a neuron implements a heuristic when its score reaches this, in (0, 1].
        families: heuristic families to score (default all that apply to ``op``).
        bottom: also score the bottom-k and keep the better side (gated MLPs).
        min_cells, max_fraction: see :func:`build_heuristics`.
        layers, neurons: ``[N]`` model layer and neuron index of each map (default 0 and 0..N-1).
        importance: ``[N]`` importance scores kept in the table.
        seed: tie-breaking permutation.
    """
    threshold = _check_threshold(threshold)
    _check_op(op, modulus)
    given = {name: m for name, m in (("k_maps", k_maps), ("kv_maps", kv_maps)) if m is not None}
    if not given:
        raise AnalysisError("give k_maps, kv_maps or both")
    a_vals, b_vals = _values_tensor("a_values", a_values), _values_tensor("b_values", b_values)
    shape = None
    for name, m in given.items():
        if not isinstance(m, torch.Tensor) or m.ndim != 3 or m.shape[1:] != (len(a_vals), len(b_vals)):
            got = tuple(m.shape) if isinstance(m, torch.Tensor) else type(m).__name__
            raise AnalysisError(
                f"{name} must be a tensor [neurons, len(a_values), len(b_values)] = [N, {len(a_vals)}, {len(b_vals)}], got {got}"
            )
        if shape is not None and m.shape != shape:
            raise AnalysisError(f"k_maps and kv_maps must have the same shape, got {tuple(shape)} and {tuple(m.shape)}")
        shape = m.shape
    N = shape[0]
    if N == 0:
        raise AnalysisError("no neuron maps given (N = 0)")
    finite = torch.ones(shape[1:], dtype=torch.bool)
    for m in given.values():
        finite &= torch.isfinite(m).all(0)
    heuristics = build_heuristics(a_vals, b_vals, op, modulus=modulus, legal=finite, families=families,
                                  min_cells=min_cells, max_fraction=max_fraction)
    flat = heuristics.legal.flatten()
    grid = heuristics.grid
    atoms = {
        "K": [_dense_ids(grid.a), _dense_ids(grid.b)],
        "KV": [_dense_ids(grid.result)],
    }
    H = len(heuristics.heuristics)
    scores = torch.full((N, H), float("nan"))
    bottom_scores = torch.full((N, H), float("nan")) if bottom else torch.empty(0)
    for kind, m in (("K", k_maps), ("KV", kv_maps)):
        cols = heuristics.kind(kind)
        if m is None or cols.numel() == 0:
            continue
        top, low = score_maps(
            m.reshape(N, -1)[:, flat].float(), heuristics.predicates[:, cols],
            atoms=atoms[kind], bottom=bottom, seed=seed, chunk_size=chunk_size, progress=progress,
        )
        scores[:, cols] = top
        if bottom:
            bottom_scores[:, cols] = low
    scored = ~torch.isnan(scores[0])
    layer_t = torch.zeros(N, dtype=torch.long) if layers is None else torch.as_tensor(layers).long()
    neuron_t = torch.arange(N) if neurons is None else torch.as_tensor(neurons).long()
    imp = torch.full((N,), float("nan")) if importance is None else torch.as_tensor(importance).float()
    for name, t in (("layers", layer_t), ("neurons", neuron_t), ("importance", imp)):
        if t.shape != (N,):
            raise AnalysisError(f"{name} must have one entry per map ([{N}]), got shape {tuple(t.shape)}")
    keep = torch.nonzero(scored).flatten()
    extra = dict(meta or {})
    extra.update(n_legal_cells=int(flat.sum()), n_cells=int(flat.numel()), dropped_heuristics=heuristics.dropped, seed=seed)
    return HeuristicTable(
        layer=layer_t,
        neuron=neuron_t,
        names=[heuristics.names[i] for i in keep.tolist()],
        families=[heuristics.families[i] for i in keep.tolist()],
        map_kinds=[heuristics.map_kinds[i] for i in keep.tolist()],
        scores=scores[:, keep],
        bottom_scores=bottom_scores[:, keep] if bottom else bottom_scores,
        importance=imp,
        threshold=threshold,
        op=op,
        modulus=modulus,
        a_values=a_vals.tolist(),
        b_values=b_vals.tolist(),
        legal=heuristics.legal,
        meta={**build_meta(), **extra},
    )


def _dense_ids(values: torch.Tensor) -> torch.Tensor:
    return torch.unique(values, return_inverse=True)[1]
