"""Fitting an :class:`~arithinterp.probes.ErrorDetector`: its parameters, one set of layers, what the fit records.

:func:`check_params` validates the constructor's arguments when fitting (scikit-learn style);
:func:`fit_candidate` fits every slot probe and the direct probe on every cross-validation fold
and on all rows, scores each method out of fold, calibrates it (a :class:`MonotoneLogistic`: P(correct)
may only rise with its features) and thresholds it; :func:`fit_meta` records the fit and warns
when the selected method does not beat always answering one way.
"""

from __future__ import annotations

import statistics
import warnings
from typing import TYPE_CHECKING, Any, Optional, Sequence

import numpy as np
import torch

from arithinterp import sites as site_lib
from arithinterp.errors import ConfigError, accepted
from arithinterp.probes.estimators import CircularProbe, MonotoneLogistic, RidgeProbe
from arithinterp.probes.logistic import LogisticProbe
from arithinterp.probes.operating_points import (
    THRESHOLD_RULES, Z_95, best_threshold, detection_metrics, fold_predictions,
)
from arithinterp.probes.slot_probes import (
    DETECTOR_METHODS, agreement, direct_probe, fit_batched, fit_problems, method_features, p_correct, slot_targets,
)
from arithinterp.probes.slots import DETECTOR_POSITIONS
from arithinterp.results import build_meta

if TYPE_CHECKING:
    from arithinterp.probes.detector import ErrorDetector


DETECTOR_SOLVERS = ("batched", "per-target")


class DetectorBaselineWarning(UserWarning):
    """The detector's cross-validated accuracy does not beat always predicting the majority class."""


def check_params(detector: ErrorDetector) -> Any:
    """Validate a detector's constructor arguments (checked when fitting, scikit-learn style).

    Args:
        detector: The detector about to be fitted.

    Returns:
        The probe to clone per target (``LogisticProbe(C=0.05)`` when ``probe`` is ``None``).

    Raises:
        ConfigError: an argument is refused (the message names it and what is accepted).
    """
    if detector.method not in DETECTOR_METHODS + ("auto",):
        raise ConfigError(f"unknown method {detector.method!r}; accepted: {accepted(DETECTOR_METHODS + ('auto',))}")
    if detector.position not in DETECTOR_POSITIONS:
        raise ConfigError(f"unknown position {detector.position!r}; accepted: {accepted(DETECTOR_POSITIONS)}")
    if not (isinstance(detector.cv, (int, np.integer)) and detector.cv >= 2):
        raise ConfigError(f"cv must be an integer >= 2 (folds), got {detector.cv!r}")
    if detector.solver not in DETECTOR_SOLVERS:
        raise ConfigError(f"unknown solver {detector.solver!r}; accepted: {accepted(DETECTOR_SOLVERS)}")
    if detector.truth not in ("answer", "slot"):
        raise ConfigError(
            f"truth must be 'answer' or 'slot' (what the true-value probes read), got {detector.truth!r}")
    t = detector.threshold
    if not (t in THRESHOLD_RULES or (isinstance(t, (int, float)) and not isinstance(t, bool) and 0 <= t <= 1)):
        raise ConfigError(
            f"threshold must be a probability in [0, 1] or one of {accepted(THRESHOLD_RULES)}, got {t!r}")
    seconds = detector.max_seconds
    if seconds is not None and not (isinstance(seconds, (int, float)) and not isinstance(seconds, bool)
                                    and 0 < seconds < float("inf")):
        raise ConfigError(f"max_seconds must be a positive finite number of seconds or None, got {seconds!r}")
    most = detector.max_candidates
    if most is not None and not (isinstance(most, (int, np.integer)) and not isinstance(most, bool) and most >= 1):
        raise ConfigError(f"max_candidates must be a positive int (layer candidates tried) or None, got {most!r}")
    if isinstance(detector.layers, str) and detector.layers != "auto":
        raise ConfigError(f"layers must be 'auto', None (every layer), a layer index or a list of them, "
                          f"got {detector.layers!r}")
    site_lib.check_site(detector.site)
    probe = LogisticProbe(C=0.05) if detector.probe is None else detector.probe
    classifier = isinstance(probe, CircularProbe) or (hasattr(probe, "predict_proba")
                                                      and not isinstance(probe, RidgeProbe))
    if not (hasattr(probe, "fit") and hasattr(probe, "get_params") and classifier):
        raise ConfigError(
            f"probe must be a classifier estimator with fit / predict_proba (e.g. LogisticProbe(), MLPProbe(), "
            f"CircularProbe() or a scikit-learn classifier), got {type(probe).__name__}"
        )
    return probe


def rank(row: dict) -> tuple[float, float]:
    """How cross-validated rows are compared: out-of-fold AUROC, then balanced accuracy.

    Args:
        row: A row of ``ErrorDetector.validation_``.

    Returns:
        ``(auroc, balanced_accuracy)``, NaN read as 0.
    """
    return float(np.nan_to_num(row["auroc"])), float(np.nan_to_num(row["balanced_accuracy"]))


def selected_row(detector: ErrorDetector) -> dict:
    """The cross-validated row of the method a fitted detector selected.

    Args:
        detector: A fitted detector.

    Returns:
        Its row of ``validation_``.
    """
    return next(r for r in detector.validation_ if r["method"] == detector.method_)


def positions_read(position: str, n_slots: int) -> str:
    """The positions the slots are read at, in words.

    Args:
        position: ``"final"`` or ``"final-only"``.
        n_slots: How many answer slots are read.

    Returns:
        A phrase for messages and ``meta``.
    """
    if position == "final-only" or n_slots == 1:
        return "the final prompt token"
    return f"the position before each of the {n_slots} answer tokens (the model's own answer fed back)"


def _calibrator() -> MonotoneLogistic:
    """A logistic model from a method's features to P(correct) that can only rise with them (Platt
    scaling for one feature, stacking for several)."""
    return MonotoneLogistic(C=1.0)


def fit_candidate(detector: ErrorDetector, probe: Any, X: torch.Tensor, slots: dict, carries: Optional[dict],
                  layers: Sequence[int]) -> None:
    """Fit every probe, calibrator and threshold of ``detector`` on ``X``; sets its fitted
    attributes except ``meta_``.

    Args:
        detector: The detector (its parameters say how: ``cv``, ``random_state``, ``truth``,
            ``solver``, ``threshold``, ``method``).
        probe: The slot probe to clone per target.
        X: Slot activations [N, L, S, d] of the layers ``layers``.
        slots: :func:`~arithinterp.probes.answer_slots` labels.
        carries: :func:`~arithinterp.probes.answer_carries` labels, or ``None``.
        layers: The layers on axis 1 of ``X``.
    """
    detector.layers_ = [int(layer) for layer in layers]
    correct = slots["correct"].bool()
    Xs = X.permute(0, 2, 1, 3).flatten(2)  # [N, S, L·d]: the chosen layers side by side
    # slots read at the same position share one activation: the direct probe sees each once
    detector.direct_slots_ = [s for s in range(Xs.shape[1])
                              if not any(torch.equal(Xs[:, s], Xs[:, t]) for t in range(s))]
    detector.n_slots_, detector.n_features_ = Xs.shape[1], Xs.shape[2]
    from sklearn.model_selection import StratifiedKFold

    folds = list(StratifiedKFold(detector.cv, shuffle=True, random_state=detector.random_state).split(
        np.zeros(len(correct)), correct.numpy()))
    train = torch.zeros(len(folds) + 1, len(correct), dtype=torch.bool)  # the folds' training rows, then all
    for f, (rows, _) in enumerate(folds):
        train[f, rows] = True
    train[-1] = True

    # slot probes: each target fitted on every fold and on all rows; agreements scored out of fold
    detector.slot_targets_ = slot_targets(slots, carries)
    detector.slot_probes_ = []
    n = len(correct)
    agree = {name: torch.ones(n, detector.n_slots_) for name in ("digit", "carry")}
    Xd = Xs[:, detector.direct_slots_].flatten(1)  # every distinct slot, side by side [N, S'·L·d]
    slot_features = [Xs[:, s].contiguous() for s in range(detector.n_slots_)]
    keys, problems = [], []
    for s in range(detector.n_slots_):
        for name, labels, mask in detector.slot_targets_[s]:
            features = Xd if (detector.truth == "answer" and name.startswith("true")) else slot_features[s]
            keys.append((s, name))
            problems.append((features, labels.expand(len(train), -1), mask & train))
    direct = direct_probe(probe)
    direct_problem = (Xd, correct.long().expand(len(train), -1), train)
    if detector.solver == "batched" and type(probe) is LogisticProbe:
        fits = dict(zip(keys, fit_batched(probe, problems)))
        fitted = fit_batched(direct, [direct_problem])[0]
    else:
        fits = {key: fit_problems(probe, *problem) for key, problem in zip(keys, problems)}
        fitted = fit_problems(direct, *direct_problem)
    for s in range(detector.n_slots_):
        by_target = {name: fits[s, name] for name, _, _ in detector.slot_targets_[s]}
        detector.slot_probes_.append({name: models[-1] for name, models in by_target.items()})
        for f, (_, rows) in enumerate(folds):
            rows = torch.as_tensor(rows)
            X_truth = Xd[rows] if detector.truth == "answer" else Xs[rows, s]
            for kind in ("digit", "carry"):
                if f"true_{kind}" in by_target:
                    agree[kind][rows, s] = agreement(by_target[f"true_{kind}"][f], by_target[f"output_{kind}"][f],
                                                     X_truth, Xs[rows, s])
    # the direct probe, class-balanced
    detector.direct_probe_ = fitted[-1]
    p_direct = torch.empty(n)
    for f, (_, rows) in enumerate(folds):
        p_direct[rows] = p_correct(fitted[f], Xd[torch.as_tensor(rows)])

    # per method: out-of-fold features → calibrated out-of-fold P(correct), threshold, scores
    valid = slots["valid"]
    features, detector.combined_columns_ = method_features(agree, p_direct, valid)
    from sklearn.model_selection import cross_val_predict

    y = correct.numpy()
    detector.calibrators_, detector.thresholds_, detector.validation_ = {}, {}, []
    oof = {}
    rule = detector.threshold
    for method in DETECTOR_METHODS:
        F = features[method]
        proba = np.asarray(cross_val_predict(_calibrator(), F, y, cv=folds, method="predict_proba"))
        oof[method] = torch.as_tensor(proba[:, 1])
        detector.calibrators_[method] = _calibrator().fit(F, y)
        threshold = best_threshold(correct, oof[method], rule) if isinstance(rule, str) else float(rule)
        detector.thresholds_[method] = threshold
        # each fold thresholded where the other folds put it: the rows scored never chose it
        row = detection_metrics(correct, fold_predictions(correct, oof[method], folds, rule), oof[method])
        detector.validation_.append(dict(method=method, threshold=threshold, **row))
    candidates = [r for r in detector.validation_ if detector.method in ("auto", r["method"])]
    detector.method_ = max(candidates, key=rank)["method"]
    detector.oof_proba_ = oof[detector.method_]


def fit_meta(detector: ErrorDetector, probe: Any, carries: bool, n_wrong: int, n: int, search: list,
             searched: bool) -> None:
    """Set ``detector.meta_`` for the fitted detector, and warn when it does not beat chance.

    The selected row is the best of every method and layer candidate compared: its interval is
    widened for that many comparisons (Bonferroni), so a search over noise does not pass.

    Args:
        detector: The fitted detector.
        probe: The slot probe it cloned.
        carries: Whether carry probes were fitted.
        n_wrong: How many fitting answers are wrong.
        n: How many fitting answers there are.
        search: One row per layer candidate tried (layers, method and out-of-fold scores).
        searched: Whether the layers were chosen by the search.
    """
    best = selected_row(detector)
    # the selected row is the best of every method and layer candidate compared: its interval is
    # widened for that many comparisons (Bonferroni), so a search over noise does not pass
    compared = (len(DETECTOR_METHODS) if detector.method == "auto" else 1) * len(search)
    z = statistics.NormalDist().inv_cdf(1 - 0.025 / compared)
    se = (best["balanced_accuracy"] - best["balanced_accuracy_low"]) / Z_95
    bound = best["balanced_accuracy"] - z * se
    beats = bool(bound > 0.5)
    where = positions_read(detector.position, detector.n_slots_)
    detector.meta_ = build_meta(
        method=detector.method_, method_choice="best out-of-fold AUROC" if detector.method == "auto" else "fixed",
        threshold=detector.thresholds_[detector.method_], threshold_rule=detector.threshold, cv=detector.cv,
        layers=detector.layers_, layer_choice="best out-of-fold AUROC" if searched else "fixed", layer_search=search,
        site=detector.site, position=detector.position, positions_read=where, probe=repr(probe), carries=carries,
        random_state=detector.random_state, n_fit=n, n_fit_errors=n_wrong,
        validation={r["method"]: {k: r[k] for k in ("balanced_accuracy", "balanced_accuracy_low",
                                                     "balanced_accuracy_high", "accuracy", "majority_baseline",
                                                     "auroc", "error_precision", "error_recall")}
                    for r in detector.validation_},
        chance_bound=float(bound), compared=compared,
        beats_majority_baseline=beats, beats_majority_accuracy=bool(best["accuracy"] > best["majority_baseline"]),
    )
    if not beats:
        tried = ", ".join(str(r["layers"]) for r in search)
        warnings.warn(
            f"the error detector does not beat always predicting the majority class: its cross-validated "
            f"balanced accuracy ({best['balanced_accuracy']:.3f}, {detector.method_}; the lower end of its 95% "
            f"interval, widened for the {compared} methods and layer sets compared, is {bound:.3f}) is not above "
            f"the 0.5 that always answering 'correct' or 'wrong' "
            f"scores (accuracy {best['accuracy']:.3f} against the majority's {best['majority_baseline']:.3f}, "
            f"out-of-fold AUROC {best['auroc']:.3f}); tried {detector.site} at layers {tried}, read at {where}; "
            "its flags are not worth acting on",
            DetectorBaselineWarning, stacklevel=3,
        )
