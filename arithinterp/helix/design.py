"""The helix basis and the pure-tensor pieces of a fit (Kantamneni & Tegmark 2025).

:func:`basis` builds the design matrix ``[cos(2πx/T), sin(2πx/T) for T in periods] + [x / max_x]
+ [1]`` (and the baselines ``"circle"``, ``"poly"``, ``"linear"``) of one or several variables;
:func:`helix_basis` is its helix / circle shorthand. Minimum-norm least squares, R², the
train / test split over *values* (:func:`split_by_value`) and the PCA of activations are the
tensor operations every fit is made of; no model is involved.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Union, cast

import numpy as np
import torch

from arithinterp.errors import AnalysisError, ConfigError, accepted
from arithinterp.types import checked

#: Numbers to fit on: a tensor, an array, or a list of numbers (``[N]`` or ``[N, n_values]``).
Values = Union[torch.Tensor, np.ndarray, Sequence[object]]

BASIS_KINDS = ("helix", "circle", "poly", "linear")
DEFAULT_PERIODS = (2, 5, 10, 100)


# --- the basis -----------------------------------------------------------------------------------


def as_2d(values: Any) -> torch.Tensor:
    values = torch.as_tensor(values, dtype=torch.float64)
    if values.ndim == 1:
        values = values[:, None]
    if values.ndim != 2 or values.shape[0] == 0:
        raise AnalysisError(f"values must be [n] or [n, n_variables] with n > 0, got shape {tuple(values.shape)}")
    return values


MAX_PERIOD = 1e6  # a circle that whole numbers walk a millionth of a turn at a time is a constant column


def check_periods(periods: Sequence[float]) -> list[float]:
    """The periods as floats, each from 2 to :data:`MAX_PERIOD`: on whole numbers a period under 2
    aliases to a longer one (period 1 is a constant), and a far longer one is constant too.

    Args:
        periods: The periods of the helix's circles.

    Returns:
        The periods as floats.

    Raises:
        ConfigError: A period is not finite or outside 2..:data:`MAX_PERIOD`.
    """
    periods = [float(T) for T in periods]
    if any(not math.isfinite(T) or not 2 <= T <= MAX_PERIOD for T in periods):
        raise ConfigError(f"periods must be numbers from 2 to {MAX_PERIOD:.0e} (e.g. 2, 5, 10, 100 or 113/14): a "
                          f"period under 2 aliases on whole numbers and a far longer one is constant; got {periods}")
    return periods


def variable_names(names: Optional[Sequence[str]], n_vars: int) -> list[str]:
    if names is None:
        return ["x"] if n_vars == 1 else [f"x{i}" for i in range(n_vars)]
    names = list(names)
    if len(names) != n_vars:
        raise AnalysisError(f"got {len(names)} variable names for {n_vars} variables")
    return names


@checked
def basis(
    values: Values,
    kind: str = "helix",
    periods: Sequence[float] = DEFAULT_PERIODS,
    *,
    max_value: Union[float, Sequence[float], None] = None,
    degree: Optional[int] = None,
    names: Optional[Sequence[str]] = None,
) -> tuple[torch.Tensor, list[str]]:
    """Basis columns for numbers (Kantamneni & Tegmark 2025).

    ``kind``:

    * ``"helix"``: per variable ``cos / sin(2πx/T)`` for each period, then ``x / max_x``;
    * ``"circle"``: the periodic columns only;
    * ``"poly"``: ``(x / max_x)^j`` for ``j = 1..degree``;
    * ``"linear"``: ``x / max_x``;

    then one constant column.

    Args:
        values: The numbers, ``[n]`` or ``[n, n_variables]``.
        kind: ``"helix"``, ``"circle"``, ``"poly"`` or ``"linear"``.
        periods: The periods ``T`` of the periodic columns.
        max_value: The scale of each variable (default ``max(values)``, at least 1).
        degree: The ``"poly"`` degree (default: the helix's column count ``2·len(periods) + 1``,
            so both have as many parameters).
        names: One name per variable, for the labels (default ``x`` or ``x0, x1, ...``).

    Returns:
        ``(matrix, labels)``: the columns Float[Tensor, "n column"] (float64) and their labels
        (``"cos(2πx/10)"``, ``"x/99"``, ``"1"``).

    Raises:
        ConfigError: An unknown kind, non-positive periods, no period for a periodic kind, or a
            poly degree below 1.
        AnalysisError: Empty values, a ``max_value`` or ``names`` per variable of the wrong length.
    """
    if kind not in BASIS_KINDS:
        raise ConfigError(f"unknown basis kind {kind!r}; accepted: {accepted(BASIS_KINDS)}")
    x = as_2d(values)
    periods = check_periods(periods)
    names = variable_names(names, x.shape[1])
    if max_value is None:
        max_value = x.max(0).values.clamp_min(1.0).tolist()
    if isinstance(max_value, (list, tuple)):
        max_value = [float(m) for m in max_value]
    else:
        max_value = [float(cast(float, max_value))]
    if len(max_value) != x.shape[1] or any(m <= 0 for m in max_value):
        raise AnalysisError(f"max_value needs one positive number per variable ({x.shape[1]}), got {max_value}")
    if kind in ("helix", "circle") and not periods:
        raise ConfigError(f"a {kind} basis needs at least one period")
    degree = 2 * len(periods) + 1 if degree is None else int(degree)
    if kind == "poly" and degree < 1:
        raise ConfigError(f"poly degree must be ≥ 1, got {degree}")
    columns, labels = [], []
    for j, name in enumerate(names):
        v = x[:, j]
        if kind in ("helix", "circle"):
            for T in periods:
                angle = 2 * math.pi * v / T
                columns += [angle.cos(), angle.sin()]
                labels += [f"cos(2π{name}/{T:g})", f"sin(2π{name}/{T:g})"]
        if kind in ("helix", "linear"):
            columns.append(v / max_value[j])
            labels.append(f"{name}/{max_value[j]:g}")
        if kind == "poly":
            for power in range(1, degree + 1):
                columns.append((v / max_value[j]) ** power)
                labels.append(f"({name}/{max_value[j]:g})^{power}")
    columns.append(torch.ones(x.shape[0], dtype=torch.float64))
    labels.append("1")
    return torch.stack(columns, dim=1), labels


@checked
def helix_basis(values: Values, periods: Sequence[float] = DEFAULT_PERIODS, *, linear: bool = True,
                constant: bool = True, max_value: Optional[Sequence[float]] = None) -> torch.Tensor:
    """The helix basis of numbers.

    Args:
        values: The numbers, ``[n]`` or ``[n, n_variables]``.
        periods: The periods ``T``.
        linear: Include the ``x / max_x`` column.
        constant: Include the constant column.
        max_value: The scale of each variable (default ``max(values)``, at least 1).

    Returns:
        Float[Tensor, "n column"]: ``2·len(periods)`` periodic columns per variable (+1 linear)
        (+1 constant), float64.
    """
    matrix, _ = basis(values, "helix" if linear else "circle", periods, max_value=max_value)
    return matrix if constant else matrix[:, :-1]


# --- least squares, held-out splits, PCA ---------------------------------------------------------


def least_squares(design: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Minimum-norm least squares (tolerates all-zero columns such as ``sin(πx)``)."""
    return torch.linalg.pinv(design, rtol=1e-10) @ target


def r2_scores(pred: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Per-column R² [c] and the variance-weighted overall R² of ``pred`` vs ``target`` [n, c]."""
    residual = (target - pred).pow(2).sum(0)
    total = (target - target.mean(0)).pow(2).sum(0)
    per = 1 - residual / total.clamp_min(1e-30)
    overall = 1 - float(residual.sum()) / max(float(total.sum()), 1e-30)
    return per, overall


@checked
def split_by_value(values: Values, holdout: float = 0.2, seed: int = 0) -> torch.Tensor:
    """A train / test split over values, not prompts: a random share of the distinct values of the
    first variable is held out with all their rows.

    Args:
        values: The numbers, ``[n]`` or ``[n, n_variables]``.
        holdout: The share of distinct values held out, in [0, 1).
        seed: Seeds the choice.

    Returns:
        Bool[Tensor, "n"]: True at the training rows.

    Raises:
        ConfigError: ``holdout`` outside [0, 1).
        AnalysisError: The split leaves an empty train or test set.
    """
    x = as_2d(values)
    if not 0 <= holdout < 1:
        raise ConfigError(f"holdout must be in [0, 1), got {holdout}")
    unique = x[:, 0].unique()
    n_test = int(round(holdout * len(unique)))
    if holdout > 0 and not 1 <= n_test < len(unique):
        raise AnalysisError(f"holdout={holdout} of {len(unique)} distinct values leaves an empty train or test set")
    generator = torch.Generator().manual_seed(int(seed))
    test_values = unique[torch.randperm(len(unique), generator=generator)[:n_test]]
    return ~torch.isin(x[:, 0], test_values)


def pca_basis(acts: torch.Tensor, n_pca: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Mean [d], top components [k, d] and their variances [k] of acts [n, d]."""
    mean = acts.mean(0)
    _, singular, vh = torch.linalg.svd(acts - mean, full_matrices=False)
    rank = int((singular > singular[0] * 1e-9).sum()) if singular.numel() and singular[0] > 0 else 0
    k = max(1, min(n_pca, rank))
    return mean, vh[:k], singular[:k].pow(2) / max(acts.shape[0] - 1, 1)
