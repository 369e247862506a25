"""Scoring a detector's calls: detection metrics, the balanced accuracy's interval, thresholds, budgets.

Errors are the flagged class: a call is "correct" when the score (P(correct)) is at or above a
threshold. Thresholds come from scores by a rule (:func:`best_threshold`), out of fold where the
rows scored must not choose their own threshold (:func:`fold_predictions`).
"""

from __future__ import annotations

import math
from typing import Any, Sequence, Union

import numpy as np
import torch

from arithinterp.errors import ConfigError, accepted
from arithinterp.types import checked

THRESHOLD_RULES = ("auto", "accuracy", "balanced")
ACCURACY_TOLERANCE = 0.01  # "auto": thresholds within one point of the best accuracy count as equally accurate
Z_95 = 1.959964  # two-sided 95% normal quantile


@checked
def detection_metrics(correct: torch.Tensor, predicted_correct: torch.Tensor, score: torch.Tensor) -> dict:
    """Balanced accuracy first, then accuracy against the majority-class baseline, AUROC (score
    = P(correct)), error precision / recall (flags as the positive class), precision / recall /
    F1 with *correct* as the positive class, the error rate and the flagged fraction.

    ``majority_baseline`` is the accuracy of always predicting the more frequent outcome (for a
    model wrong 88% of the time that is "always wrong", not "always correct");
    ``always_correct_accuracy`` is the other trivial rule. ``baseline_accuracy`` is an alias of
    ``majority_baseline``.

    Args:
        correct: BoolTensor [N], the truth.
        predicted_correct: BoolTensor [N], the detector's call.
        score: [N], the detector's P(correct).

    Returns:
        The metrics by name (floats; ``n`` and ``n_errors`` ints; ``beats_chance`` a bool); AUROC
        is NaN when one class is missing.
    """
    from sklearn import metrics as skm

    truth, pred = correct.bool().numpy(), predicted_correct.bool().numpy()
    both = len(np.unique(truth)) == 2
    rate = float(truth.mean()) if len(truth) else float("nan")
    flagged, wrong = ~pred, ~truth
    balanced, low, high = balanced_accuracy_interval(correct, predicted_correct)
    return dict(
        balanced_accuracy=balanced,
        accuracy=float((truth == pred).mean()),
        majority_baseline=max(rate, 1 - rate),
        auroc=float(skm.roc_auc_score(truth, score.double().numpy())) if both else float("nan"),
        error_precision=float((flagged & wrong).sum() / max(flagged.sum(), 1)),
        error_recall=float((flagged & wrong).sum() / max(wrong.sum(), 1)),
        # scikit-learn infers zero_division: str from its "warn" default; 0 is a documented value
        precision=float(skm.precision_score(truth, pred, zero_division=0)),  # pyright: ignore[reportArgumentType]
        recall=float(skm.recall_score(truth, pred, zero_division=0)),  # pyright: ignore[reportArgumentType]
        f1=float(skm.f1_score(truth, pred, zero_division=0)),  # pyright: ignore[reportArgumentType]
        always_correct_accuracy=rate,
        baseline_accuracy=max(rate, 1 - rate),
        error_rate=1 - rate,
        flagged_fraction=float(flagged.mean()),
        n=int(len(truth)),
        n_errors=int(wrong.sum()),
        balanced_accuracy_low=low,
        balanced_accuracy_high=high,
        beats_chance=bool(low > 0.5),
    )


@checked
def balanced_accuracy_interval(correct: torch.Tensor, predicted_correct: torch.Tensor) -> tuple[float, float, float]:
    """Balanced accuracy and its 95% interval (normal approximation over the two classes).

    Balanced accuracy is the mean of the two recalls, correct answers called correct (``tpr``) and
    wrong answers flagged (``tnr``), each a proportion over its own class, so its standard error
    is ``0.5 · sqrt(tpr (1 − tpr) / n_correct + tnr (1 − tnr) / n_wrong)``. Always answering
    "correct" or always "wrong" scores 0.5: a detector beats both when the lower end is above it.

    Args:
        correct: BoolTensor [N], the truth.
        predicted_correct: BoolTensor [N], the detector's call.

    Returns:
        ``(balanced_accuracy, low, high)``; all NaN when one class is missing.
    """
    truth, pred = correct.bool(), predicted_correct.bool()
    n_right, n_wrong = int(truth.sum()), int((~truth).sum())
    if n_right == 0 or n_wrong == 0:
        return float("nan"), float("nan"), float("nan")
    tpr = float((pred & truth).sum()) / n_right
    tnr = float((~pred & ~truth).sum()) / n_wrong
    balanced = (tpr + tnr) / 2
    se = 0.5 * math.sqrt(tpr * (1 - tpr) / n_right + tnr * (1 - tnr) / n_wrong)
    return balanced, balanced - Z_95 * se, balanced + Z_95 * se


@checked
def best_threshold(correct: torch.Tensor, score: torch.Tensor, rule: str = "accuracy") -> float:
    """The score threshold (predict correct when ``score >= threshold``) chosen by ``rule``.

    Tied scores cannot be split; among equally good thresholds the lowest (fewest flags) wins.

    Args:
        correct: BoolTensor [N], the truth.
        score: [N], P(correct).
        rule: ``"balanced"`` (the best balanced accuracy: errors and correct answers weigh the
            same however rare either is), ``"accuracy"`` (the most accurate; with few errors that
            is close to never flagging, with many close to always) or ``"auto"`` (the best
            balanced accuracy among thresholds whose accuracy is within ``ACCURACY_TOLERANCE`` of
            the best).

    Returns:
        The threshold: between two scores, ``-inf`` (flag nothing) or ``inf`` (flag everything).

    Raises:
        ConfigError: ``rule`` is unknown.
    """
    if rule not in THRESHOLD_RULES:
        raise ConfigError(f"unknown threshold rule {rule!r}; accepted: {accepted(THRESHOLD_RULES)}")
    order = score.argsort()
    s, c = score[order].double(), correct[order].double()
    zero = torch.zeros(1, dtype=torch.float64)
    wrong_below = torch.cat([zero, (1 - c).cumsum(0)])  # flagged and wrong, splitting before i
    correct_above = c.sum() - torch.cat([zero, c.cumsum(0)])
    accuracy = (wrong_below + correct_above) / max(len(s), 1)
    balanced = (wrong_below / (1 - c).sum().clamp_min(1) + correct_above / c.sum().clamp_min(1)) / 2
    splittable = torch.ones(len(s) + 1, dtype=torch.bool)
    splittable[1:-1] = s[1:] > s[:-1]  # tied scores cannot be separated
    if rule == "accuracy":
        value = torch.where(splittable, accuracy, -1.0)
    else:
        value = torch.where(splittable, balanced, -1.0)
        if rule == "auto":
            best = torch.where(splittable, accuracy, -1.0).max()
            value = torch.where(accuracy >= best - ACCURACY_TOLERANCE, value, -1.0)
    i = int(value.argmax())
    if i == 0:
        return float("-inf")
    return float("inf") if i == len(s) else float((s[i - 1] + s[i]) / 2)


def budget_flags(score: torch.Tensor, budget: float) -> torch.Tensor:
    """The ``ceil(budget * N)`` lowest-scoring rows (ties broken by order).

    Args:
        score: [N], P(correct).
        budget: The fraction of rows to flag, in (0, 1].

    Returns:
        BoolTensor [N], True for the flagged rows.

    Raises:
        ConfigError: ``budget`` is not a fraction in (0, 1].
    """
    if not (isinstance(budget, (int, float)) and 0 < budget <= 1):
        raise ConfigError(f"budget must be a fraction of prompts in (0, 1], got {budget!r}")
    k = math.ceil(budget * len(score) - 1e-9)
    flags = torch.zeros(len(score), dtype=torch.bool)
    flags[torch.argsort(score, stable=True)[:k]] = True
    return flags


def fold_predictions(correct: torch.Tensor, score: torch.Tensor, folds: Sequence[tuple[Any, Any]],
                     rule: Union[str, float]) -> torch.Tensor:
    """Out-of-fold calls: each fold's rows thresholded where ``rule`` puts the threshold on the
    *other* folds' scores, so the metrics of these calls are not flattered by choosing the
    threshold on the rows they score.

    Args:
        correct: BoolTensor [N], the truth.
        score: [N], out-of-fold P(correct).
        folds: ``(train_rows, test_rows)`` per fold.
        rule: A rule of :func:`best_threshold`, or a number (a fixed threshold).

    Returns:
        BoolTensor [N], the calls (True: predicted correct).
    """
    if not isinstance(rule, str):
        return score >= float(rule)
    predicted = torch.zeros(len(score), dtype=torch.bool)
    for train, test in folds:
        train, test = torch.as_tensor(train), torch.as_tensor(test)
        predicted[test] = score[test] >= best_threshold(correct[train], score[train], rule)
    return predicted
