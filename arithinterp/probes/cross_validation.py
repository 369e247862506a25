"""Cross-validation of a probe: the folds (grouped so that no operand pair is on both sides) and
the held-out scores of one layer x position cell.

:func:`resolve_groups` decides which prompts share a fold, :func:`check_folds` refuses a fold count the
prompts cannot be split into, :func:`make_folds` makes the folds,
:func:`probe_cell` fits a fresh clone of the estimator on every fold of every label set (one
L-BFGS run for a :class:`~arithinterp.probes.LogisticProbe`), and :func:`confidence_interval`
gives the Student-t interval of the mean over folds.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import numpy as np
import torch

from arithinterp.errors import AnalysisError, ConfigError
from arithinterp.intervals import t_interval
from arithinterp.probes.estimators import CircularProbe, MLPProbe, RidgeProbe
from arithinterp.probes.logistic import LogisticProbe
from arithinterp.probes.probe_base import clone_estimator, to_tensor
from arithinterp.types import OpenUnitFloat, checked

if TYPE_CHECKING:
    from arithinterp.tasks import PromptSet


@checked
def resolve_groups(prompts: Optional[PromptSet], groups: Any, n: int) -> tuple[Optional[np.ndarray], Optional[str]]:
    """Cross-validation groups (or ``None``: no grouping) and their name.

    Args:
        prompts: The prompts (``None``: only an array or ``None`` works).
        groups: ``"auto"`` (group by operand pair when some ``(a, b)`` occurs more than once,
            e.g. prompt sets with several few-shot prefixes pooled; else none), ``"pair"``, a label
            name of ``prompts.label`` (``"a"`` holds out whole a values), an array of ``n`` group
            ids, or ``None`` (plain folds).
        n: How many prompts there are.

    Returns:
        ``(ids [n] or None, name)``: ``"pair"``, the label's name, ``"custom"`` or ``None``.

    Raises:
        ConfigError: ``groups`` names no label.
        AnalysisError: the groups need prompts that are missing, or have the wrong length.
    """
    if groups is None:
        return None, None
    if isinstance(groups, str):
        if prompts is None:
            if groups == "auto":
                return None, None
            raise AnalysisError(
                f"groups={groups!r} needs activations that carry their prompts; pass an array of {n} group ids")
        if groups in ("auto", "pair"):
            pairs = torch.stack([prompts.a, prompts.b], 1)
            ids = torch.unique(pairs, dim=0, return_inverse=True)[1].numpy()
            if groups == "auto" and len(np.unique(ids)) == n:
                return None, None
            return ids, "pair"
        try:
            return prompts.label(groups).numpy(), groups
        except ConfigError as error:
            raise ConfigError(f"groups: {error}; or 'auto', 'pair', None, or an array of {n} group ids") from error
    ids = np.asarray(to_tensor(groups, "groups"))
    if ids.ndim != 1 or len(ids) != n:
        raise AnalysisError(f"groups must have one group per prompt ({n}), got shape {ids.shape}")
    return ids, "custom"


def check_folds(cv: Any, n: int, groups: Optional[np.ndarray] = None) -> None:
    """Refuse a number of folds that ``n`` samples (in these groups) cannot be split into.

    Args:
        cv: The number of folds.
        n: The number of samples.
        groups: Group ids [n] (every member of a group in the same fold), or ``None``.

    Raises:
        ConfigError: ``cv`` is not an integer of at least 2.
        AnalysisError: too few samples or groups for ``cv`` folds.
    """
    if not isinstance(cv, (int, np.integer)) or cv < 2:
        raise ConfigError(f"cv must be an integer number of folds >= 2, got {cv!r}")
    if n < 2 * cv:
        raise AnalysisError(f"too few samples for {cv}-fold cross-validation: {n}; need at least {2 * cv}")
    if groups is not None and len(np.unique(groups)) < cv:
        raise AnalysisError(f"{cv}-fold cross-validation grouped by these groups needs at least {cv} groups, "
                            f"got {len(np.unique(groups))} groups; lower cv or choose other groups")


def make_folds(y: torch.Tensor, cv: int, stratify: bool, random_state: int,
           groups: Optional[np.ndarray] = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """``cv`` shuffled (train, test) index splits; every member of a group in the same fold.

    Args:
        y: The labels [n].
        cv: The number of folds (at least 2).
        stratify: Stratify by label where every class has ``cv`` members.
        random_state: The seed of the shuffle.
        groups: Group ids [n], or ``None``.

    Returns:
        ``cv`` pairs of index arrays.

    Raises:
        ConfigError: ``cv`` is not an integer of at least 2.
        AnalysisError: too few samples or groups for ``cv`` folds.
    """
    from sklearn.model_selection import GroupKFold, KFold, StratifiedGroupKFold, StratifiedKFold

    check_folds(cv, len(y), groups)
    n = len(y)
    labels = y.numpy()
    stratify = stratify and np.unique(labels, return_counts=True)[1].min() >= cv
    if groups is None:
        splitter = (StratifiedKFold if stratify else KFold)(cv, shuffle=True, random_state=random_state)
        return list(splitter.split(np.zeros(n), labels))
    splitter = (StratifiedGroupKFold if stratify else GroupKFold)(cv, shuffle=True, random_state=random_state)
    return list(splitter.split(np.zeros(n), labels, groups))


def fold_scheme(
    cv: int, stratified: bool, groups: Optional[np.ndarray], group_name: Optional[str], asked: Any
) -> dict:
    """How the folds were made, in words (``text``) and numbers, for the result's meta.

    Args:
        cv: The number of folds.
        stratified: Whether they are stratified by label.
        groups: The group ids, or ``None``.
        group_name: The groups' name (:func:`resolve_groups`).
        asked: What the caller asked for (``"auto"`` explains an ungrouped scheme).

    Returns:
        ``cv``, ``stratified``, ``groups``, the group counts and ``text``.
    """
    info: dict[str, Any] = dict(cv=cv, stratified=stratified, groups=group_name)
    if groups is None:
        why = " (no pair repeats)" if asked == "auto" and group_name is None else ""
        info["text"] = f"{cv}-fold{', stratified by label' if stratified else ''}, ungrouped{why}"
        return info
    counts = np.unique(groups, return_counts=True)[1]
    info.update(n_groups=len(counts), largest_group=int(counts.max()))
    what = ("(a, b) pair" if group_name == "pair"
            else "the given groups" if group_name == "custom" else f"label {group_name!r}")
    info["text"] = (f"{cv}-fold grouped by {what} ({len(counts)} groups, up to {int(counts.max())} prompts each)"
                    f"{', stratified by label' if stratified else ''}")
    return info


def is_classifier(estimator: Any) -> bool:
    """Whether ``estimator`` predicts discrete labels (scored by accuracy) rather than values (R²).

    Args:
        estimator: Our probe or a scikit-learn estimator.

    Returns:
        ``True`` for a classifier.
    """
    from sklearn.base import is_classifier

    if isinstance(estimator, (LogisticProbe, CircularProbe, MLPProbe)):
        return True
    if isinstance(estimator, RidgeProbe):
        return False
    return is_classifier(estimator)


def _as_input(estimator: Any, X: torch.Tensor) -> Any:
    """Our probes take tensors; other scikit-learn estimators get numpy arrays."""
    ours = (LogisticProbe, RidgeProbe, MLPProbe)
    return X if isinstance(estimator, ours) else X.numpy()


def read_out_directions(probe: Any) -> Optional[torch.Tensor]:
    """Unit read-out rows of a fitted linear probe (``directions_`` or ``coef_``).

    Args:
        probe: A fitted estimator.

    Returns:
        ``[k, d]``, or ``None`` for a probe without a linear read-out.
    """
    if hasattr(probe, "directions_"):
        return probe.directions_
    coef = getattr(probe, "coef_", None)
    if coef is None:
        return None
    coef = torch.as_tensor(np.asarray(coef), dtype=torch.float32).reshape(-1, probe.n_features_in_)
    return coef / coef.norm(dim=1, keepdim=True).clamp_min(1e-12)


def probe_cell(estimator: Any, X: torch.Tensor, label_sets: list, folds, full: bool):
    """Held-out scores for each label set on the same folds (each fit on a fresh ``clone`` of
    ``estimator``), and (when ``full``) the probe fitted on every sample of the first label set.

    Args:
        estimator: The estimator to clone.
        X: Features [n, d].
        label_sets: Labels [n] per set (the target, then controls such as shuffled labels).
        folds: ``(train, test)`` index pairs.
        full: Also fit on every sample of the first label set.

    Returns:
        ``(scores [len(label_sets), n_folds], fitted probe or None)``.
    """
    if type(estimator) is LogisticProbe:  # every fold of every label set (and the full fit) in one L-BFGS run
        masks = torch.zeros(len(folds), len(X), dtype=torch.bool)
        for f, (train, _) in enumerate(folds):
            masks[f, train] = True
        targets = torch.cat([y.expand(len(folds), -1) for y in label_sets] + ([label_sets[0][None]] if full else []))
        masks = torch.cat([masks] * len(label_sets) + ([torch.ones(1, len(X), dtype=torch.bool)] if full else []))
        fitted = clone_estimator(estimator).fit_many(X, targets, masks)
        scores = [[fitted[s * len(folds) + f].score(X[test], y[test]) for f, (_, test) in enumerate(folds)]
                  for s, y in enumerate(label_sets)]
        return torch.tensor(scores), (fitted[-1] if full else None)
    X_in = _as_input(estimator, X)
    Y_in = [_as_input(estimator, y) for y in label_sets]
    scores = [[float(clone_estimator(estimator).fit(X_in[train], y[train]).score(X_in[test], y[test]))
               for train, test in folds]
              for y in Y_in]
    full_fit = full and not isinstance(estimator, MLPProbe)  # a non-linear probe has no directions to keep
    return torch.tensor(scores), (clone_estimator(estimator).fit(X_in, Y_in[0]) if full_fit else None)


@checked
def confidence_interval(scores: torch.Tensor, level: OpenUnitFloat = 0.95) -> tuple[torch.Tensor, torch.Tensor]:
    """Student-t interval of the mean over the last axis (folds), unclipped
    (:attr:`ProbeResult.ci <arithinterp.probes.ProbeResult.ci>` clips it to the metric's range).

    Args:
        scores: [..., folds].
        level: The confidence level.

    Returns:
        ``(low, high)``, each [...].
    """
    return t_interval(scores, level)
