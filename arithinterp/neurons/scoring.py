"""Classifying neuron maps into heuristics: the scores (:mod:`~arithinterp.neurons.map_scores`), the
cell-shuffle test (:mod:`~arithinterp.neurons.shuffle_test`) and the labels, into a :class:`HeuristicTable`.

:func:`classify_maps` classifies maps given whole; :func:`classify_stream` classifies maps that come
in chunks, keeping only the table's ``[neurons, heuristics]`` scores.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Sequence

import numpy as np
import torch

from arithinterp.engine.budget import chunk_for
from arithinterp.errors import AnalysisError, ConfigError
from arithinterp.neurons.heuristics import build_heuristics, values_tensor
from arithinterp.neurons.registry import HeuristicRegistry, check_registry
from arithinterp.neurons.rules import MAP_KINDS, check_op
from arithinterp.neurons.map_scores import SCORE_CHUNK, score_all
from arithinterp.neurons.shuffle_test import RunningFDR, RunningNullSummary, check_fdr, deciding_p_values
from arithinterp.neurons.table import HeuristicTable
from arithinterp.progress import progress_bar
from arithinterp.results import build_meta
from arithinterp.types import ByteSize, Modulus, PositiveInt, checked


def check_threshold(threshold: float) -> float:
    """Refuse a threshold outside (0, 1].

    Args:
        threshold: The score a label needs.

    Returns:
        ``threshold`` as a float.

    Raises:
        ConfigError: ``threshold`` is not a number in (0, 1].
    """
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0 < threshold <= 1:
        raise ConfigError(f"threshold must be a number in (0, 1], got {threshold!r}")
    return float(threshold)


@checked
def classify_maps(
    k_maps: Optional[torch.Tensor],
    kv_maps: Optional[torch.Tensor],
    a_values: Iterable[int],
    b_values: Iterable[int],
    op: str,
    *,
    threshold: float = 0.6,
    fdr: Optional[float] = 0.05,
    shuffle_control: bool = True,
    registry: Optional[HeuristicRegistry] = None,
    modulus: Optional[Modulus] = None,
    families: Optional[Sequence[str]] = None,
    bottom: bool = False,
    min_cells: PositiveInt = 3,
    max_fraction: float = 0.5,
    layers: Optional[torch.Tensor] = None,
    neurons: Optional[torch.Tensor] = None,
    importance: Optional[torch.Tensor] = None,
    seed: int = 0,
    chunk_size: PositiveInt = SCORE_CHUNK,
    max_memory: Optional[ByteSize] = None,
    progress: bool = True,
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
        chunk_size: neurons whose tie-breaking permutations are drawn together.
        max_memory: bytes the scoring may use at once on top of the maps and the table (neurons
            are scored in chunks of ``chunk_size`` multiples; ``None``: all at once). The table is
            the same whatever the chunking.
        progress: show a progress bar.
        meta: entries added to the table's ``meta``.

    Returns:
        The maps' classification (a :class:`HeuristicTable`).

    Raises:
        AnalysisError: no maps, or maps of the wrong shape.
        ConfigError: a threshold, FDR, ``modulus``, ``min_cells`` or ``chunk_size`` is refused.
        TaskError: an unknown operator.
    """
    check_threshold(threshold)
    check_fdr(fdr)
    check_op(op)
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


def rows_per_chunk(n_cells: int, n_legal: int, n_heuristics: int, chunk_size: int, max_memory: Optional[ByteSize],
                   n_rows: int, share: float = 1.0) -> int:
    """Neurons scored per chunk: a multiple of ``chunk_size`` (so the seeded tie-breaks are the
    same whatever the chunking) whose maps and scores fit in ``share`` of ``max_memory`` bytes.

    Args:
        n_cells: Grid cells per map.
        n_legal: Legal cells per map.
        n_heuristics: Heuristics scored.
        chunk_size: The unit of a chunk.
        max_memory: Bytes available (``None``: one chunk of every row).
        n_rows: How many neurons there are.
        share: The share of ``max_memory`` a chunk may use.

    Returns:
        Rows per chunk.
    """
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
    """:func:`classify_maps` over neurons whose maps come in chunks.

    Only the table's ``[neurons, heuristics]`` scores are kept; the false-discovery correction runs
    over all of them at the end, so the table equals the one of all maps at once.

    Args:
        source: ``source(start, stop)`` gives ``(k_maps, kv_maps)`` ``[stop - start, A, B]`` of rows
            ``start:stop`` (``None`` for a kind not in ``kinds``).
        n_neurons: How many rows ``source`` serves.
        a_values: The first operand's values along axis 1.
        b_values: The second operand's values along axis 2.
        op: The task's operator.
        threshold: The score a label needs.
        legal: BoolTensor ``[A, B]``, the cells to score.
        kinds: The map kinds ``source`` serves (``"K"``, ``"KV"``).
        fdr: As :func:`classify_maps`.
        shuffle_control: As :func:`classify_maps`.
        registry: As :func:`classify_maps`.
        modulus: As :func:`classify_maps`.
        families: As :func:`classify_maps`.
        bottom: As :func:`classify_maps`.
        min_cells: As :func:`classify_maps`.
        max_fraction: As :func:`classify_maps`.
        layers: As :func:`classify_maps`.
        neurons: As :func:`classify_maps`.
        importance: As :func:`classify_maps`.
        seed: As :func:`classify_maps`.
        chunk_size: As :func:`classify_maps`.
        max_memory: Bytes the chunks may use (``None``: one chunk).
        memory_share: The share of ``max_memory`` the chunks hold.
        progress: Show a progress bar.
        meta: Entries added to the table's ``meta``.

    Returns:
        The maps' classification (a :class:`HeuristicTable`).

    Raises:
        AnalysisError: no maps, or per-map entries of the wrong length.
        ConfigError: a threshold or FDR is refused.
        TaskError: an unknown operator.
    """
    threshold = check_threshold(threshold)
    fdr = check_fdr(fdr)
    check_op(op)
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
    fdr_p = RunningFDR()
    null = RunningNullSummary(N, threshold, fdr) if shuffle_control else None
    starts = range(0, N, rows)
    for start in progress_bar(starts, desc="classify neurons", disable=not progress or len(starts) < 2):
        stop = min(start + rows, N)
        k_chunk, kv_chunk = source(start, stop)
        by_kind = {"K": k_chunk if "K" in kinds else None, "KV": kv_chunk if "KV" in kinds else None}
        top, low = score_all(by_kind, heuristics, atoms, bottom, seed, chunk_size, False, offset=start)
        top, low = top[:, keep], (low[:, keep] if bottom else None)
        scores[start:stop] = top
        if low is not None:
            bottom_scores[start:stop] = low
        p_values[start:stop] = deciding_p_values(top, low, counts, n_legal).numpy()
        fdr_p.add(p_values[start:stop])
        if null is not None:  # shuffle_control
            n_top, n_low = score_all(by_kind, heuristics, atoms, bottom, seed, chunk_size, False, shuffle=True,
                                      offset=start)
            n_top, n_low = n_top[:, keep], (n_low[:, keep] if bottom else None)
            null.add(start, _best(n_top, n_low, bottom) if n_low is not None else n_top,
                     deciding_p_values(n_top, n_low, counts, n_legal).numpy())
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
