"""The cell-shuffle test of a heuristic label: exact p-values and a false-discovery-rate correction.

When a neuron's values are permuted over the legal cells, its top-k cells are a uniformly random
k-subset, so its score on a heuristic of k cells is hypergeometric (:func:`shuffle_p_values`);
Benjamini–Hochberg adjusts the p-values over every neuron x heuristic (:func:`benjamini_hochberg`,
or :class:`RunningFDR` over chunks), and :class:`RunningNullSummary` states what cell-shuffled maps get.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np
import torch

from arithinterp.errors import AnalysisError, ConfigError
from arithinterp.types import checked


def check_fdr(fdr: Optional[float]) -> Optional[float]:
    """Refuse a false-discovery rate outside (0, 1).

    Args:
        fdr: The rate, or ``None`` (the threshold alone).

    Returns:
        ``fdr`` as a float, or ``None``.

    Raises:
        ConfigError: ``fdr`` is not a number in (0, 1) or ``None``.
    """
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

    Args:
        p_values: p-values of any shape (NaN: not a test).

    Returns:
        float64 q-values, the shape of ``p_values``.
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


class RunningFDR:
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
        """Count a chunk of p-values (NaN entries are not tests).

        Args:
            p: p-values of any shape.
        """
        p = np.asarray(p, dtype=np.float64).ravel()
        values, counts = np.unique(p[~np.isnan(p)], return_counts=True)
        merged, inverse = np.unique(np.concatenate([self.values, values]), return_inverse=True)
        self.counts = np.bincount(inverse, weights=np.concatenate([self.counts, counts]),
                                  minlength=len(merged)).astype(np.int64)
        self.values, self._q = merged, None

    def q_of_values(self) -> np.ndarray:
        """The q-value of each distinct p-value (ascending).

        Returns:
            float64 [distinct p-values].
        """
        if self._q is None:
            m = int(self.counts.sum())
            last_rank = np.cumsum(self.counts).astype(np.float64)  # the tie group's last rank
            scaled = self.values * m / last_rank
            self._q = np.minimum(np.minimum.accumulate(scaled[::-1])[::-1], 1.0)
        return self._q

    def q(self, p: np.ndarray) -> np.ndarray:
        """q-values of p-values that were added (NaN stays NaN).

        Args:
            p: p-values that were added, any shape.

        Returns:
            Their q-values, the same shape.
        """
        p = np.asarray(p, dtype=np.float64)
        out = np.full(p.shape, np.nan)
        tested = ~np.isnan(p)
        if len(self.values):
            out[tested] = self.q_of_values()[np.searchsorted(self.values, p[tested])]
        return out

    def largest_discovery(self, fdr: float) -> float:
        """The largest p-value whose q-value is ≤ ``fdr`` (−inf if none): q grows with p, so the
        discoveries are exactly the p-values up to it.

        Args:
            fdr: The false-discovery rate.

        Returns:
            The p-value.
        """
        hit = np.flatnonzero(self.q_of_values() <= fdr)
        return float(self.values[hit[-1]]) if len(hit) else -math.inf


class RunningNullSummary:
    """What cell-shuffled maps get, from chunks of them: how many neurons are labelled, by the
    threshold alone and under the stated control, and quantiles of each neuron's best score. Per
    neuron it keeps its best score and the smallest p-value among its heuristics over the
    threshold; of all tests, and of those over the threshold, the distinct p-values' counts.

    Args:
        n: How many neurons there are.
        threshold: The score a label needs.
        fdr: The false-discovery rate (``None``: the threshold alone).
    """

    def __init__(self, n: int, threshold: float, fdr: Optional[float]):
        self.threshold, self.fdr = threshold, fdr
        self.top = torch.empty(n, dtype=torch.float64)
        self.over_any = torch.zeros(n, dtype=torch.bool)
        self.min_p_over = torch.full((n,), math.inf, dtype=torch.float64)
        self.all_p, self.over_p = RunningFDR(), RunningFDR()
        self.n_over = 0

    def add(self, start: int, best: torch.Tensor, p: np.ndarray) -> None:
        """Count the shuffled maps of rows ``start:start + len(best)``.

        Args:
            start: The chunk's first row.
            best: The deciding scores [n, H].
            p: Their p-values [n, H].
        """
        stop = start + best.shape[0]
        over = (best >= self.threshold).numpy()
        self.top[start:stop] = best.nan_to_num(-1.0).max(1).values.double()
        self.over_any[start:stop] = torch.from_numpy(over.any(1))
        self.min_p_over[start:stop] = torch.from_numpy(np.where(over, p, np.inf).min(1))
        self.all_p.add(p)
        self.over_p.add(p[over])
        self.n_over += int(over.sum())

    def summary(self) -> dict:
        """What the shuffled maps got.

        Returns:
            ``neurons``, ``labelled_by_threshold``, ``labelled``, ``fraction_labelled``, ``labels`` and
            the best scores' median, 95th and 99th percentiles and maximum.
        """
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


def deciding_p_values(top: torch.Tensor, low: Optional[torch.Tensor], counts: torch.Tensor,
                      n_cells: int) -> torch.Tensor:
    """Cell-shuffle p-values of the deciding score: the top-k, or with ``low`` the better of the
    two sides (Bonferroni over the two: 2 × the smaller p).

    Args:
        top: Top-k scores [N, H] (NaN where unscored).
        low: Bottom-k scores [N, H], or ``None``.
        counts: The k of each heuristic [H].
        n_cells: The number of legal cells.

    Returns:
        float64 [N, H] (NaN where unscored).
    """
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
