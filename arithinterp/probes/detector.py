"""The probe-based error detector: flags prompts the model will answer wrongly.

Detection metrics (:func:`detection_metrics`, :func:`best_threshold`), the slot probes'
agreement, :class:`ErrorDetector` (output-digit / true-digit disagreement, or a direct
correct-vs-wrong probe) and its result on a prompt set, :class:`DetectorResult`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any, Optional, Sequence, Union

import numpy as np
import torch

from arithinterp import sites as site_lib
from arithinterp.errors import AnalysisError, ConfigError, accepted
from arithinterp.probes.answers import _n_digits, _slot_valid, answer_activations, answer_slots
from arithinterp.probes.estimators import CircularProbe, _tensor, make_probe
from arithinterp.results import Result, build_meta

DETECTOR_METHODS = ("disagreement", "direct")
DETECTOR_POSITIONS = ("final", "final_only")


# --- where each answer slot is read ---------------------------------------------------------------


def _slot_offsets(prompts: Any, position: str) -> torch.Tensor:
    """Offset from the final prompt token of the position read for each answer slot [S]."""
    if position not in DETECTOR_POSITIONS:
        raise ConfigError(f"unknown position {position!r}; accepted: {accepted(DETECTOR_POSITIONS)}")
    k = prompts.answer_tokens.shape[1]
    if k == 1:  # a single answer token: every digit of it is read where it is predicted
        return torch.zeros(_n_digits(prompts), dtype=torch.long)
    return torch.arange(k) if position == "final" else torch.zeros(k, dtype=torch.long)


# --- error detection (pure tensor part) -----------------------------------------------------------


def detection_metrics(correct: torch.Tensor, predicted_correct: torch.Tensor, score: torch.Tensor) -> dict:
    """Accuracy, balanced accuracy, AUROC, precision / recall / F1 with *correct* as the positive
    class, the error rate and the trivial always-correct baseline accuracy."""
    from sklearn import metrics as skm

    truth, pred = correct.bool().numpy(), predicted_correct.bool().numpy()
    both = len(np.unique(truth)) == 2
    return dict(
        accuracy=float((truth == pred).mean()),
        balanced_accuracy=float(skm.balanced_accuracy_score(truth, pred)) if both else float("nan"),
        auroc=float(skm.roc_auc_score(truth, score.double().numpy())) if both else float("nan"),
        precision=float(skm.precision_score(truth, pred, zero_division=0)),
        recall=float(skm.recall_score(truth, pred, zero_division=0)),
        f1=float(skm.f1_score(truth, pred, zero_division=0)),
        error_rate=float(1 - truth.mean()),
        baseline_accuracy=float(truth.mean()),
        flagged_fraction=float(1 - pred.mean()),
        n=int(len(truth)),
        n_errors=int((~truth).sum()),
    )


def best_threshold(correct: torch.Tensor, score: torch.Tensor) -> float:
    """The score threshold (predict correct when ``score >= threshold``) with the highest accuracy."""
    order = score.argsort()
    s, c = score[order].double(), correct[order].double()
    zero = torch.zeros(1, dtype=torch.float64)
    wrong_below = torch.cat([zero, (1 - c).cumsum(0)])  # flagged and wrong, splitting before i
    correct_above = c.sum() - torch.cat([zero, c.cumsum(0)])
    accuracy = wrong_below + correct_above
    splittable = torch.ones(len(s) + 1, dtype=torch.bool)
    splittable[1:-1] = s[1:] > s[:-1]  # tied scores cannot be separated
    i = int(torch.where(splittable, accuracy, -1.0).argmax())
    if i == 0:
        return float("-inf")
    return float("inf") if i == len(s) else float((s[i - 1] + s[i]) / 2)


class _Constant:
    """A slot whose training labels have a single value: predicts it with certainty."""

    def __init__(self, value: int):
        self.classes_ = torch.tensor([value])

    def predict(self, X):
        return self.classes_.expand(len(X))

    def predict_proba(self, X):
        return torch.ones(len(X), 1)


def _class_probs(probe: Any, X: torch.Tensor, period: int = 10) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probs [n, k], classes [k])`` for a slot probe (a circular probe gives a soft one-hot)."""
    if isinstance(probe, CircularProbe):
        classes = torch.arange(probe.period)
        gap = probe.predict_angle(X)[:, None] - 2 * math.pi * classes[None] / probe.period
        return (probe.period * gap.cos()).softmax(-1), classes
    return probe.predict_proba(X), probe.classes_


def _agreement(true_probe: Any, output_probe: Any, X: torch.Tensor) -> torch.Tensor:
    """Probability that the true-digit and output-digit probes name the same value [n]."""
    p_true, c_true = _class_probs(true_probe, X)
    p_out, c_out = _class_probs(output_probe, X)
    match = (c_true[:, None] == c_out[None, :]).float()  # [k_true, k_out]
    return ((p_true @ match) * p_out).sum(-1)


class ErrorDetector:
    """Flags prompts the model will answer wrongly, from its activations (RECIPES §5).

    Two methods, both fitted: ``"disagreement"`` — per answer slot, a probe for the model's
    output digit and one for the true digit; any slot where they disagree flags the prompt
    (score: probability that every slot's probes agree); ``"direct"`` — a binary probe on the
    slots' activations, concatenated, for correct vs wrong (class-balanced). With ``layer=None``
    and/or ``method="auto"`` the layer and method with the best validation balanced accuracy are
    chosen on a held-out ``val_frac`` of the fit prompts, then refitted on all of them.

    ``position="final"`` reads slot j at the final prompt token + j with the model's own answer
    fed back (the position before answer token j); ``"final_only"`` reads every slot at the final
    prompt token, flagging before anything is emitted. Single-token answers are read at the final
    token, one slot per decimal digit. ``kind`` is the slot-probe kind (``"logistic"``,
    ``"mlp"``, ``"circular"``); the direct probe is an MLP for ``"mlp"`` and logistic otherwise.
    ``threshold`` is the direct probe's P(correct) cut-off, or ``"auto"``: each method's score
    threshold with the best validation accuracy (``thresholds_``).
    """

    def __init__(self, layer: Optional[int] = None, position: str = "final", kind: str = "logistic",
                 method: str = "auto", site: str = "resid_post", val_frac: float = 0.3,
                 threshold: Union[float, str] = 0.5,
                 random_state: int = 0, batch_size: int = 256, progress: bool = False, **probe_kw: Any):
        if kind not in ("logistic", "mlp", "circular"):
            raise ConfigError(f"ErrorDetector kind must be a classifier probe; accepted: {accepted(('logistic', 'mlp', 'circular'))}")
        if method not in DETECTOR_METHODS + ("auto",):
            raise ConfigError(f"unknown method {method!r}; accepted: {accepted(DETECTOR_METHODS + ('auto',))}")
        if position not in DETECTOR_POSITIONS:
            raise ConfigError(f"unknown position {position!r}; accepted: {accepted(DETECTOR_POSITIONS)}")
        if not 0 < val_frac < 1:
            raise ConfigError(f"val_frac must be in (0, 1), got {val_frac!r}")
        if threshold != "auto" and not (isinstance(threshold, (int, float)) and 0 <= threshold <= 1):
            raise ConfigError(f"threshold must be a probability in [0, 1] or 'auto', got {threshold!r}")
        make_probe(kind, **probe_kw)
        site_lib.check_site(site)
        self.layer, self.position, self.kind, self.method, self.site = layer, position, kind, method, site
        self.val_frac, self.threshold, self.random_state = val_frac, threshold, random_state
        self.batch_size, self.progress, self.probe_kw = batch_size, progress, probe_kw

    # -- model-facing ----------------------------------------------------------------------------

    def _read(self, model: Any, prompts: Any, evaluation: Any, layers) -> tuple[torch.Tensor, Any]:
        """Slot activations ``[N, L, S, d]`` and the evaluation they were read under."""
        evaluation = evaluation if evaluation is not None else prompts.evaluate(model, batch_size=self.batch_size)
        acts = answer_activations(model, prompts, evaluation, self.site, layers, self.batch_size, self.progress)
        offsets = _slot_offsets(prompts, self.position)
        return acts.data[self.site].flatten(3)[:, :, offsets], evaluation

    def fit(self, model: Any, prompts: Any, evaluation: Any = None) -> "ErrorDetector":
        """Evaluate the model on ``prompts`` (or use ``evaluation``), read its activations, fit."""
        layers = None if self.layer is None else [self.layer]
        X, evaluation = self._read(model, prompts, evaluation, layers)
        chosen = site_lib.check_layers(model, self.site, layers)
        self.meta_ = build_meta(model, site=self.site, position=self.position, n_fit_prompts=len(prompts))
        return self.fit_activations(X, answer_slots(prompts, evaluation), layers=chosen)

    def evaluate(self, model: Any, prompts: Any, evaluation: Any = None) -> "DetectorResult":
        """Detection metrics on (held-out) ``prompts`` for both methods → :class:`DetectorResult`."""
        self._check_fitted()
        X, evaluation = self._read(model, prompts, evaluation, [self.layer_])
        result = self.evaluate_activations(X[:, 0], answer_slots(prompts, evaluation))
        return replace(result, meta={**result.meta, **build_meta(model, n_prompts=len(prompts))})

    def flag(self, model: Any, prompts: Any, evaluation: Any = None) -> torch.Tensor:
        """BoolTensor [N]: prompts predicted wrong (to re-check), by the selected method."""
        self._check_fitted()
        X, _ = self._read(model, prompts, evaluation, [self.layer_])
        return self.flag_activations(X[:, 0], _slot_valid(prompts, X.shape[2]))

    # -- tensor-facing ---------------------------------------------------------------------------

    def fit_activations(self, X: torch.Tensor, slots: dict, layers: Optional[Sequence[int]] = None) -> "ErrorDetector":
        """Fit from slot activations ``X`` [N, L, S, d] and :func:`answer_slots` labels.

        ``layers`` names axis 1 (default ``0..L-1``). Picks the layer and method on a validation
        split when ``layer`` is None or ``method="auto"``, then refits on every prompt.
        """
        X = self._check_X(X, slots)
        layers = list(range(X.shape[1])) if layers is None else list(layers)
        if len(layers) != X.shape[1]:
            raise AnalysisError(f"layers names {len(layers)} layers but X has {X.shape[1]} on axis 1")
        correct = slots["correct"]
        n_wrong, n_right = int((~correct).sum()), int(correct.sum())
        if min(n_wrong, n_right) < 2:
            raise AnalysisError(
                f"error detection needs at least 2 correct and 2 wrong answers to learn from; got {n_right} "
                f"correct and {n_wrong} wrong (use more prompts or a model that still makes errors)"
            )
        # slots read at the same position (single-token answers, "final_only") share one activation:
        # the direct probe sees each distinct position once
        self.direct_slots_ = [s for s in range(X.shape[2]) if not any(torch.equal(X[:, :, s], X[:, :, t]) for t in range(s))]
        self.validation_ = []
        auto = self.threshold == "auto"
        self.thresholds_ = {"disagreement": None, "direct": None if auto else float(self.threshold)}
        if len(layers) > 1 or self.method == "auto" or auto:
            from sklearn.model_selection import train_test_split

            train, val = train_test_split(np.arange(len(correct)), test_size=self.val_frac,
                                          random_state=self.random_state, stratify=correct.numpy())
            train, val = torch.as_tensor(train), torch.as_tensor(val)
            sub = {key: value[train] for key, value in slots.items()}
            for li, layer in enumerate(layers):
                models = self._fit_layer(X[train, li], sub)
                scores, agree_all, *_ = self._score_layer(models, X[val, li], slots["valid"][val])
                for m, method in enumerate(DETECTOR_METHODS):
                    threshold = best_threshold(correct[val], scores[:, m]) if auto else self.thresholds_[method]
                    predicted = agree_all if threshold is None else scores[:, m] >= threshold
                    row = detection_metrics(correct[val], predicted, scores[:, m])
                    self.validation_.append(dict(layer=layer, method=method, threshold=threshold, **row))
            candidates = [r for r in self.validation_ if self.method in ("auto", r["method"])]
            best = max(candidates, key=lambda r: (np.nan_to_num(r["balanced_accuracy"]), np.nan_to_num(r["auroc"])))
            self.layer_, self.method_ = best["layer"], best["method"]
            if auto:  # each method keeps the threshold it validated best with at the chosen layer
                self.thresholds_ = {r["method"]: r["threshold"] for r in self.validation_ if r["layer"] == self.layer_}
        else:
            self.layer_, self.method_ = layers[0], self.method
        self.models_ = self._fit_layer(X[:, layers.index(self.layer_)], slots)
        self.n_slots_ = X.shape[2]
        return self

    def evaluate_activations(self, X: torch.Tensor, slots: dict) -> "DetectorResult":
        """Metrics from slot activations ``X`` [N, S, d] at the chosen layer."""
        self._check_fitted()
        X = self._check_X(X[:, None], slots)[:, 0]
        scores, predicted, pred_true, pred_output = self._predict(self.models_, X, slots["valid"])
        return DetectorResult(
            correct=slots["correct"], scores=scores, predicted_correct=predicted, methods=list(DETECTOR_METHODS),
            method=self.method_, layer=int(self.layer_), position=self.position, true_slots=slots["true"],
            output_slots=slots["output"], slot_valid=slots["valid"], pred_true_slots=pred_true,
            pred_output_slots=pred_output, validation=list(self.validation_),
            meta=build_meta(kind=self.kind, site=self.site, thresholds=self.thresholds_, random_state=self.random_state),
        )

    def flag_activations(self, X: torch.Tensor, valid: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Flags from slot activations ``X`` [N, S, d]; ``valid`` [N, S] marks existing slots."""
        self._check_fitted()
        X = _tensor(X, "X").float()
        if X.ndim != 3 or X.shape[1] != self.n_slots_:
            raise AnalysisError(f"X must be [n_prompts, {self.n_slots_} slots, d], got shape {tuple(X.shape)}")
        valid = torch.ones(X.shape[:2], dtype=torch.bool) if valid is None else valid.bool()
        _, predicted, *_ = self._predict(self.models_, X, valid)
        return ~predicted[:, DETECTOR_METHODS.index(self.method_)]

    # -- internals -------------------------------------------------------------------------------

    def _check_fitted(self) -> None:
        if not hasattr(self, "models_"):
            raise AnalysisError("this ErrorDetector is not fitted yet; call fit(model, prompts) first")

    @staticmethod
    def _check_X(X: torch.Tensor, slots: dict) -> torch.Tensor:
        X = _tensor(X, "X").float()
        if X.ndim != 4:
            raise AnalysisError(f"X must be [n_prompts, n_layers, n_slots, d], got shape {tuple(X.shape)}")
        expected = tuple(slots["true"].shape)
        for key in ("output", "valid"):
            if tuple(slots[key].shape) != expected:
                raise AnalysisError(f"slots[{key!r}] has shape {tuple(slots[key].shape)}, expected {expected}")
        if (X.shape[0], X.shape[2]) != expected or slots["correct"].shape != (X.shape[0],):
            raise AnalysisError(
                f"X has {X.shape[0]} prompts x {X.shape[2]} slots but the labels are {expected}; "
                "build them together with answer_slots(prompts, evaluation)"
            )
        return X

    def _slot_probe(self, X: torch.Tensor, y: torch.Tensor):
        if len(torch.unique(y)) < 2:
            return _Constant(int(y[0])) if len(y) else _Constant(-1)
        return make_probe(self.kind, random_state=self.random_state, **self.probe_kw).fit(X, y)

    def _fit_layer(self, X: torch.Tensor, slots: dict) -> dict:
        """Per-slot true / output probes and the direct probe on one layer's ``X`` [N, S, d]."""
        true_probes, output_probes = [], []
        for s in range(X.shape[1]):
            rows = slots["valid"][:, s]
            true_probes.append(self._slot_probe(X[rows, s], slots["true"][rows, s]))
            output_probes.append(self._slot_probe(X[rows, s], slots["output"][rows, s]))
        direct_kind = "mlp" if self.kind == "mlp" else "logistic"
        direct_kw = {**(self.probe_kw if direct_kind == self.kind else {}), "class_weight": "balanced"}
        direct = make_probe(direct_kind, random_state=self.random_state, **direct_kw)
        direct.fit(X[:, self.direct_slots_].flatten(1), slots["correct"].long())
        return dict(true=true_probes, output=output_probes, direct=direct)

    def _predict(self, models: dict, X: torch.Tensor, valid: torch.Tensor):
        """``(scores [N, 2], predicted_correct [N, 2], pred_true [N, S], pred_output [N, S])``."""
        scores, agree_all, pred_true, pred_output = self._score_layer(models, X, valid)
        predicted = torch.stack([
            agree_all if self.thresholds_[method] is None else scores[:, m] >= self.thresholds_[method]
            for m, method in enumerate(DETECTOR_METHODS)
        ], dim=1)
        return scores, predicted, pred_true, pred_output

    def _score_layer(self, models: dict, X: torch.Tensor, valid: torch.Tensor):
        """``(scores [N, 2], every slot's probes agree [N], pred_true [N, S], pred_output [N, S])``."""
        agree = torch.ones(X.shape[:2])
        pred_true = torch.full(X.shape[:2], -1, dtype=torch.long)
        pred_output = pred_true.clone()
        for s, (true_probe, output_probe) in enumerate(zip(models["true"], models["output"])):
            agree[:, s] = _agreement(true_probe, output_probe, X[:, s])
            pred_true[:, s] = true_probe.predict(X[:, s])
            pred_output[:, s] = output_probe.predict(X[:, s])
        agree = torch.where(valid, agree, 1.0)
        disagreement_ok = ((pred_true == pred_output) | ~valid).all(-1)
        direct = models["direct"].predict_proba(X[:, self.direct_slots_].flatten(1))[:, 1]  # classes_ [0, 1]: P(correct)
        return torch.stack([agree.prod(-1), direct], dim=1), disagreement_ok, pred_true, pred_output


@dataclass(frozen=True)
class DetectorResult(Result):
    """An :class:`ErrorDetector` on a prompt set: per-prompt scores and metrics for each method.

    ``correct`` [N] (the truth), ``scores`` [N, M] (probability of a correct answer per method in
    ``methods``), ``predicted_correct`` [N, M]; per answer slot [N, S]: ``true_slots``,
    ``output_slots``, ``slot_valid`` and the slot probes' predictions ``pred_true_slots`` /
    ``pred_output_slots``. ``method`` is the one ``flag`` uses; ``validation`` the selection rows.
    """

    correct: torch.Tensor
    scores: torch.Tensor
    predicted_correct: torch.Tensor
    methods: list
    method: str
    layer: int
    position: str
    true_slots: torch.Tensor
    output_slots: torch.Tensor
    slot_valid: torch.Tensor
    pred_true_slots: torch.Tensor
    pred_output_slots: torch.Tensor
    validation: list
    meta: dict

    def metrics(self, method: Optional[str] = None) -> dict:
        """:func:`detection_metrics` for ``method`` (default: the selected one)."""
        method = self.method if method is None else method
        if method not in self.methods:
            raise AnalysisError(f"unknown method {method!r}; accepted: {accepted(self.methods)}")
        m = self.methods.index(method)
        return detection_metrics(self.correct, self.predicted_correct[:, m], self.scores[:, m])

    def __getitem__(self, key: str) -> float:
        """A metric of the selected method, e.g. ``result["auroc"]``."""
        values = self.metrics()
        if key not in values:
            raise AnalysisError(f"unknown metric {key!r}; accepted: {accepted(values)}")
        return values[key]

    def slot_accuracy(self) -> dict:
        """Held-out accuracy of the true-digit and output-digit probes per slot."""
        valid = self.slot_valid.float()
        hit_true = ((self.pred_true_slots == self.true_slots).float() * valid).sum(0) / valid.sum(0).clamp_min(1)
        hit_out = ((self.pred_output_slots == self.output_slots).float() * valid).sum(0) / valid.sum(0).clamp_min(1)
        return dict(true=hit_true.tolist(), output=hit_out.tolist())

    def to_frame(self):
        """One row per method with its metrics (and the layer, position, selection flag)."""
        import pandas as pd

        return pd.DataFrame([
            dict(method=m, selected=m == self.method, layer=self.layer, position=self.position, **self.metrics(m))
            for m in self.methods
        ])

    def plot(self, kind: str = "roc", slot: int = 0, probe: str = "true", **kwargs):
        """``kind="roc"``: ROC curve per method; ``"confusion"``: predicted vs actual values of
        the ``probe`` (``"true"`` or ``"output"``) digit probe at ``slot``."""
        from arithinterp.viz import probes as viz

        if kind == "roc":
            return viz.roc_curve(self, **kwargs)
        if kind == "confusion":
            return viz.digit_confusion(self, slot=slot, probe=probe, **kwargs)
        raise ConfigError(f"unknown plot kind {kind!r}; accepted: {accepted(('roc', 'confusion'))}")
