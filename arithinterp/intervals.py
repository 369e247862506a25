"""Uncertainty shared by the analyses: bootstrap intervals over pairs, ratios reported only when
their denominator is distinguishable from zero, and intervals kept inside a metric's range.

A ratio of two noisy means says nothing when the denominator's interval holds 0 (a "2.9× the
layer patch" of a layer patch of 0.03 ± 0.07 is noise divided by noise), so :func:`ratio_to_reference`
returns NaN there with the reason, and otherwise the ratio with its paired percentile-bootstrap
interval (numerator and denominator resampled over the same pairs).
"""

from __future__ import annotations

import math

import torch

from arithinterp.errors import ConfigError

# the range each score lives in: an interval never leaves it (an accuracy CI above 1 is a bug, not a finding)
METRIC_RANGES: dict[str, tuple[float, float]] = {
    "accuracy": (0.0, 1.0),
    "r2": (-math.inf, 1.0),
}


def clip_interval(low: torch.Tensor, high: torch.Tensor, metric: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Clip an interval to the range a metric lives in.

    Args:
        low: Lower bounds, any shape.
        high: Upper bounds, the shape of ``low``.
        metric: A key of :data:`METRIC_RANGES` (``"accuracy"``: [0, 1]; ``"r2"``: ≤ 1).

    Returns:
        ``(low, high)``, clamped.

    Raises:
        ConfigError: ``metric`` has no known range.
    """
    if metric not in METRIC_RANGES:
        raise ConfigError(f"unknown metric {metric!r} for an interval; accepted: {', '.join(map(repr, METRIC_RANGES))}")
    lo, hi = METRIC_RANGES[metric]
    return low.clamp(lo, hi), high.clamp(lo, hi)


def t_interval(scores: torch.Tensor, level: float = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Student-t interval of the mean over the last axis (e.g. cross-validation folds).

    Args:
        scores (Float[Tensor, "... k"]): Scores, the repeated measurements on the last axis.
        level: The confidence level.

    Returns:
        ``(low, high)``, each of shape ``[...]``; both equal the mean when ``k < 2``.
    """
    from scipy.stats import t as student_t

    k = scores.shape[-1]
    mean = scores.mean(-1)
    if k < 2:
        return mean.clone(), mean.clone()
    half = float(student_t.ppf(0.5 + level / 2, k - 1)) * scores.std(-1, unbiased=True) / math.sqrt(k)
    return mean - half, mean + half


def bootstrap_counts(n: int, n_boot: int, seed: int) -> torch.Tensor:
    """How often each of ``n`` items is drawn in each of ``n_boot`` resamples with replacement.

    Args:
        n: The number of items.
        n_boot: The number of resamples.
        seed: Seeds the draws.

    Returns:
        Float[Tensor, "n_boot n"]: Draw counts (float64); each row sums to ``n``.
    """
    generator = torch.Generator().manual_seed(int(seed))
    draws = torch.randint(n, (n_boot, n), generator=generator)
    ones = torch.ones(n_boot, n, dtype=torch.float64)
    return torch.zeros(n_boot, n, dtype=torch.float64).scatter_add_(1, draws, ones)


def bootstrap_means(values: torch.Tensor, n_boot: int = 1000, seed: int = 0) -> torch.Tensor:
    """Bootstrap means over the last axis.

    Args:
        values (Float[Tensor, "... n"]): Values, the resampled items on the last axis.
        n_boot: The number of resamples.
        seed: Seeds the resamples (the same seed draws the same items for every leading index).

    Returns:
        Float[Tensor, "n_boot ..."]: The mean of each resample (float64).
    """
    n = values.shape[-1]
    counts = bootstrap_counts(n, n_boot, seed)
    return torch.einsum("bn,...n->b...", counts, values.double()) / n


def ratio_to_reference(per_item: torch.Tensor, reference: int = 0, *, confidence: float = 0.95, n_boot: int = 1000,
                       seed: int = 0) -> dict:
    """Means of M quantities measured on the same N pairs, as fractions of one of them, each with a
    paired percentile-bootstrap interval over the pairs.

    When the reference's interval holds 0, every fraction and its interval is NaN: a share of an
    effect that may be zero is not a number worth printing.

    Args:
        per_item (Float[Tensor, "m n"]): One row per quantity, one column per pair.
        reference: The row the others are fractions of.
        confidence: The interval's confidence level, in (0, 1).
        n_boot: The number of bootstrap resamples.
        seed: Seeds the resamples.

    Returns:
        A dict of float64 tensors ``[m]``: ``mean``, ``mean_low``, ``mean_high``, ``fraction``,
        ``fraction_low``, ``fraction_high``; and ``reference_distinct`` (bool), whether the
        reference's interval excludes 0.

    Raises:
        ConfigError: ``per_item`` is not 2-D with at least two pairs, or ``confidence`` is outside (0, 1).
    """
    if per_item.ndim != 2 or per_item.shape[1] < 2:
        raise ConfigError(f"per_item must be [M quantities, N ≥ 2 pairs], got shape {tuple(per_item.shape)}")
    if not 0 < confidence < 1:
        raise ConfigError(f"confidence must be in (0, 1), got {confidence!r}")
    values = per_item.double()
    mean = values.mean(1)
    boot = bootstrap_means(values, n_boot, seed)  # [n_boot, M]
    alpha = (1 - confidence) / 2
    q = torch.tensor([alpha, 1 - alpha], dtype=torch.float64)
    low, high = torch.quantile(boot, q, dim=0)
    distinct = bool(low[reference] > 0 or high[reference] < 0)
    if distinct:
        fraction = mean / mean[reference]
        f_low, f_high = torch.quantile(boot / boot[:, reference : reference + 1], q, dim=0)
    else:
        fraction = f_low = f_high = torch.full_like(mean, float("nan"))
    return dict(mean=mean, mean_low=low, mean_high=high, fraction=fraction, fraction_low=f_low,
                fraction_high=f_high, reference_distinct=distinct)
