"""Scoring neuron maps against heuristics: the fraction of each map's top-k (or bottom-k) cells that
satisfy each heuristic (Nikankin et al. 2025), vectorised over neurons and heuristics.

:func:`score_maps` scores ``[N, C]`` maps on ``[C, H]`` predicates; :func:`score_all` scores a
table's K and KV maps on the heuristics of their kind.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from arithinterp.errors import AnalysisError
from arithinterp.progress import progress_bar
from arithinterp.types import NonNegativeInt, PositiveInt, checked

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
    chunk_size: PositiveInt = SCORE_CHUNK,
    progress: bool = False,
    shuffle: bool = False,
    offset: NonNegativeInt = 0,
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
        chunk_size: neurons whose permutations are drawn together.
        progress: show a progress bar.
        offset: the index of ``maps``' first row among all the neurons scored (a multiple of
            ``chunk_size``): maps scored in parts get the permutations of one call on all of them.
        shuffle: score cell-shuffled maps instead: each neuron's values are permuted over the C
            cells by its own seeded permutation (the null of Nikankin-style labels: same values,
            no grid structure).

    Returns:
        ``(top, bottom)`` scores, ``[N, H]`` float each (``bottom`` is ``None`` unless asked).

    Raises:
        AnalysisError: the shapes disagree, or a heuristic has no cell.
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
    for start in progress_bar(starts, desc="score heuristics", disable=not progress or len(starts) < 2):
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


def score_all(maps_by_kind, heuristics, atoms, bottom, seed, chunk_size, progress, shuffle=False, offset=0):
    """Top (and bottom) scores of the K / KV maps on the heuristics of their kind.

    Args:
        maps_by_kind: ``{"K": [N, A, B] or None, "KV": [N, A, B] or None}``.
        heuristics: The heuristic set (:func:`~arithinterp.neurons.build_heuristics`).
        atoms: Per kind, labelings of the legal cells (:func:`score_maps`'s ``atoms``).
        bottom: Also score the bottom-k.
        seed: The tie-breaking permutations' seed.
        chunk_size: Neurons whose permutations are drawn together.
        progress: Show a progress bar.
        shuffle: Score cell-shuffled maps instead.
        offset: The first row's index among all the neurons scored.

    Returns:
        ``(scores [N, H], bottom_scores [N, H] or empty)``; NaN where unscored.
    """
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
