"""The probe-based error detector: flags prompts the model will answer wrongly.

Sun, Stolfo & Sachan 2025 (EMNLP) probe each answer digit twice — for the digit the model writes
and for the true digit — and flag an answer where the two disagree; they also fit a direct
correct-vs-wrong probe. :class:`ErrorDetector` fits both, adds carry probes (the carry a digit
needs against the carry the model's digit implies; the make-carry / sum-9 cascades of Quirke &
Barez 2023-24 are where small models fail), reads several layers at once, combines the per-slot
scores with a logistic model, calibrates every method and chooses method and threshold by
cross-validation inside ``fit``. :class:`DetectorResult` is its result on a prompt set.
"""

from __future__ import annotations

import hashlib
import math
import statistics
import warnings
import weakref
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import numpy as np
import torch
from sklearn.base import BaseEstimator

from arithinterp.checks import check_belongs
from arithinterp import sites as site_lib
from arithinterp.errors import AnalysisError, ConfigError, accepted
from arithinterp.probes.answers import answer_digit_count, answer_slot_mask, answer_activations, answer_slots
from arithinterp.probes.estimators import (
    CircularProbe, LogisticProbe, MonotoneLogistic, NotFittedError, RidgeProbe, clone_estimator, feature_eigenbasis,
    to_tensor,
)
from arithinterp.results import NON_NEGATIVE, Result, build_meta
from arithinterp.types import checked

if TYPE_CHECKING:
    from arithinterp.tasks import Evaluation
    from arithinterp.tasks import PromptSet
    from arithinterp.types import HookedModel

DETECTOR_METHODS = ("disagreement", "direct", "combined")
DETECTOR_POSITIONS = ("final", "final_only")
THRESHOLD_RULES = ("auto", "accuracy", "balanced")
DETECTOR_SOLVERS = ("batched", "per-target")
ACCURACY_TOLERANCE = 0.01  # "auto": thresholds within one point of the best accuracy count as equally accurate
JOINT_MAX_FEATURES = 4096  # layers="auto" also tries all layers side by side up to this many direct-probe features
Z_95 = 1.959964  # two-sided 95% normal quantile


class DetectorBaselineWarning(UserWarning):
    """The detector's cross-validated accuracy does not beat always predicting the majority class."""


# --- the model's answers, generated once per prompt set --------------------------------------------

_ANSWERS: "weakref.WeakKeyDictionary[Any, OrderedDict]" = weakref.WeakKeyDictionary()
_ANSWERS_KEPT = 8  # prompt sets remembered per model (an Evaluation is a few integers per prompt)


def _prompts_key(prompts: Any) -> str:
    """A digest of what decides the model's answers and their scoring: tokens, lengths, answers."""
    digest = hashlib.sha1()
    for tensor in (prompts.tokens, prompts.lengths, prompts.answer_tokens):
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{tuple(tensor.shape)}{tensor.dtype}".encode())
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


def model_answers(model: HookedModel, prompts: PromptSet, batch_size: Optional[int] = None) -> Evaluation:
    """``prompts.evaluate(model)``, generated once per model and prompt set.

    Greedy decoding is deterministic, so the answers are kept (for the last few prompt sets of
    each model, keyed on the prompts' tokens and answers and on the model's parameters, which a
    change to any weight invalidates): a detector fitted, evaluated and asked to flag on one
    prompt set generates its answers once.
    """
    from arithinterp.engine.stepping import model_fingerprint

    key = (model_fingerprint(model), _prompts_key(prompts))
    try:
        kept = _ANSWERS.setdefault(model, OrderedDict())
    except TypeError:  # not weak-referenceable: nothing is kept
        return prompts.evaluate(model, batch_size=batch_size)
    if key in kept:
        kept.move_to_end(key)
        return kept[key]
    evaluation = kept[key] = prompts.evaluate(model, batch_size=batch_size)
    while len(kept) > _ANSWERS_KEPT:
        kept.popitem(last=False)
    return evaluation


def _shared_prefix_slots(model: Any, prompts: Any, evaluation: Any, site: str, layers: Sequence[int],
                         batch_size: int) -> Optional[torch.Tensor]:
    """Activations before each answer token ``[N, L, K, *site_shape]`` with the model's own
    answer fed back (as :func:`~arithinterp.probes.answers.answer_activations`), from stepped
    runs that compute the prompts' shared first tokens (a few-shot prefix) once per batch;
    ``None`` where the engine cannot do that (then the whole forwards of ``collect`` run)."""
    from arithinterp.engine.budget import forward_bytes_per_prompt
    from arithinterp.engine.decode import MIN_BUDGET
    from arithinterp.engine.stepping import read_last
    from arithinterp.probes.answers import check_evaluation

    if site in site_lib.GLOBAL_SITES or site == "pattern":
        return None
    check_evaluation(prompts, evaluation)
    k, cfg = prompts.answer_tokens.shape[1], model.cfg
    names = [site_lib.hook_name(site, layer) for layer in layers]
    shape = site_lib.site_shape(model, site)
    out = torch.empty(len(prompts), len(layers), k, *shape)
    # a stepped base run keeps every block's input, keys and values and the reads: size batches for that
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    width, first = int(torch.tensor(shape).prod()), True
    for group in prompts.length_groups():
        tokens = torch.cat([prompts.unpadded(group), evaluation.generated_tokens[group, : k - 1]], dim=1)
        T = tokens.shape[1]
        kv_width = 2 * (getattr(cfg, "n_key_value_heads", None) or cfg.n_heads) * cfg.d_head
        per_prompt = forward_bytes_per_prompt(model, T) + 4 * T * (
            (cfg.n_layers + 1) * cfg.d_model + cfg.n_layers * kv_width + len(layers) * width)
        size = max(1, min(batch_size, int(max(0.5 * model_bytes, MIN_BUDGET) // per_prompt)))
        for chunk in torch.arange(len(group)).split(size):
            rows = tokens[chunk].to(getattr(cfg, "device", None) or "cpu")
            read = read_last(model, rows, names, k, only_if_shared=first)
            if read is None:  # decided on the first batch: the others share the same prefix
                return None
            first = False
            for i, name in enumerate(names):
                out[group[chunk], i] = read[name].reshape(len(chunk), k, *shape).float().cpu()
    return out


# --- where each answer slot is read ---------------------------------------------------------------


def _slot_offsets(prompts: Any, position: str) -> torch.Tensor:
    """Offset from the final prompt token of the position read for each answer slot [S]."""
    if position not in DETECTOR_POSITIONS:
        raise ConfigError(f"unknown position {position!r}; accepted: {accepted(DETECTOR_POSITIONS)}")
    k = prompts.answer_tokens.shape[1]
    if k == 1:  # a single answer token: every digit of it is read where it is predicted
        return torch.zeros(answer_digit_count(prompts), dtype=torch.long)
    return torch.arange(k) if position == "final" else torch.zeros(k, dtype=torch.long)


@checked
def answer_carries(prompts: PromptSet, slots: dict) -> Optional[dict]:
    """Per answer slot: the carry into its digit that the sum needs and the one the model used.

    Quirke & Barez: an answer digit is (a_i + b_i + carry_in) mod 10, and small models fail on
    the carry, above all in sum-9 cascades. ``true`` [N, S] is the carry into the slot's digit
    (0 / 1); ``output`` [N, S] is the carry the model's digit implies, ``(digit - a_i - b_i) mod
    10`` (0, 1, or 2 for "neither": the digit is wrong for another reason). ``valid`` [N, S]
    marks slots that are a digit with a carry into it. ``None`` when the prompts are not
    addition of non-negative numbers written one digit per slot (carries are then undefined).
    """
    if getattr(prompts, "op", None) != "+" or getattr(prompts, "modulus", None) is not None:
        return None
    a, b = prompts.a.long(), prompts.b.long()
    if (a < 0).any() or (b < 0).any():
        return None
    valid = slots["valid"]
    if ((slots["true"] < 0) | (slots["true"] > 9))[valid].any():
        return None  # a slot spells more than one digit (e.g. a BPE token "12")
    n, n_slots = slots["true"].shape
    if prompts.answer_tokens.shape[1] == 1:  # single-token answers: slot s is digit s (units first)
        power = torch.arange(n_slots)[None, :].expand(n, n_slots)
    else:  # one token per digit, most significant first
        power = (prompts.n_answer_tokens[:, None] - 1 - torch.arange(n_slots)[None, :]).clamp_min(0)
    scale = 10**power
    true = ((a[:, None] % scale) + (b[:, None] % scale) >= scale).long()
    base = (a[:, None] // scale) % 10 + (b[:, None] // scale) % 10
    output = (slots["output"] - base) % 10
    output = torch.where((slots["output"] >= 0) & (output <= 1), output, 2)
    return dict(true=true, output=output, valid=valid & (power > 0))


# --- metrics and operating points -----------------------------------------------------------------


@checked
def detection_metrics(correct: torch.Tensor, predicted_correct: torch.Tensor, score: torch.Tensor) -> dict:
    """Balanced accuracy first, then accuracy against the majority-class baseline, AUROC (score
    = P(correct)), error precision / recall (flags as the positive class), precision / recall /
    F1 with *correct* as the positive class, the error rate and the flagged fraction.

    ``majority_baseline`` is the accuracy of always predicting the more frequent outcome (for a
    model wrong 88% of the time that is "always wrong", not "always correct");
    ``always_correct_accuracy`` is the other trivial rule. ``baseline_accuracy`` is an alias of
    ``majority_baseline``.
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
    """The score threshold (predict correct when ``score >= threshold``) chosen by ``rule``:
    ``"balanced"`` (the best balanced accuracy: errors and correct answers weigh the same however
    rare either is), ``"accuracy"`` (the most accurate; with few errors that is close to never
    flagging, with many close to always) or ``"auto"`` (the best balanced accuracy among
    thresholds whose accuracy is within ``ACCURACY_TOLERANCE`` of the best). Tied scores cannot
    be split; among equally good thresholds the lowest (fewest flags) wins."""
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


def _budget_flags(score: torch.Tensor, budget: float) -> torch.Tensor:
    """The ``ceil(budget * N)`` lowest-scoring rows [N] (ties broken by order)."""
    if not (isinstance(budget, (int, float)) and 0 < budget <= 1):
        raise ConfigError(f"budget must be a fraction of prompts in (0, 1], got {budget!r}")
    k = math.ceil(budget * len(score) - 1e-9)
    flags = torch.zeros(len(score), dtype=torch.bool)
    flags[torch.argsort(score, stable=True)[:k]] = True
    return flags


# --- slot probes ----------------------------------------------------------------------------------


def fold_predictions(correct: torch.Tensor, score: torch.Tensor, folds: Sequence[tuple[Any, Any]],
                     rule: Union[str, float]) -> torch.Tensor:
    """Out-of-fold calls [N]: each fold's rows thresholded where ``rule`` puts the threshold on
    the *other* folds' scores (:func:`best_threshold`; a number is a fixed threshold), so the
    metrics of these calls are not flattered by choosing the threshold on the rows they score."""
    if not isinstance(rule, str):
        return score >= float(rule)
    predicted = torch.zeros(len(score), dtype=torch.bool)
    for train, test in folds:
        train, test = torch.as_tensor(train), torch.as_tensor(test)
        predicted[test] = score[test] >= best_threshold(correct[train], score[train], rule)
    return predicted


class _Constant:
    """A target with a single value in its training rows: predicts it with certainty."""

    def __init__(self, value: int):
        self.classes_ = torch.tensor([value])

    def predict(self, X):
        return self.classes_.expand(len(X))

    def predict_proba(self, X):
        return torch.ones(len(X), 1)


def _class_probs(probe: Any, X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probs [n, k], classes [k])`` for a slot probe (a circular probe gives a soft one-hot)."""
    if isinstance(probe, CircularProbe):
        classes = torch.arange(probe.period)
        gap = probe.predict_angle(X)[:, None] - 2 * math.pi * classes[None] / probe.period
        return (probe.period * gap.cos()).softmax(-1), classes
    probs = torch.as_tensor(np.asarray(probe.predict_proba(X)), dtype=torch.float32)
    return probs, torch.as_tensor(np.asarray(probe.classes_)).long()


def _likelihood(probe: Any, X: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Probability the probe gives to ``value`` [n] (0 for a value it never saw)."""
    probs, classes = _class_probs(probe, X)
    hit = (value[:, None] == classes[None, :]).float()
    return (probs * hit).sum(-1)


def _fit_problems(probe: Any, X: torch.Tensor, labels: torch.Tensor, masks: torch.Tensor) -> list:
    """One fitted clone of ``probe`` per row of ``labels`` / ``masks`` [B, n] (the rows where the
    mask is True); a constant where only one value is present. Logistic probes are fitted as one
    block-separable problem (``LogisticProbe.fit_many``)."""
    fitted: list = [None] * len(labels)
    todo = []
    for i in range(len(labels)):
        values = torch.unique(labels[i][masks[i]])
        if len(values) < 2:
            fitted[i] = _Constant(int(values[0]) if len(values) else -1)
        else:
            todo.append(i)
    if todo and type(probe) is LogisticProbe:
        many = clone_estimator(probe).fit_many(X, labels[todo], masks[todo])
        for i, one in zip(todo, many):
            fitted[i] = one
    else:
        for i in todo:
            fitted[i] = clone_estimator(probe).fit(X[masks[i]], labels[i][masks[i]])
    return fitted


def _fit_batched(probe: Any, problems: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> list[list]:
    """:func:`_fit_problems` for many problems at once, for a :class:`LogisticProbe`.

    ``problems``: ``(features [n, d], labels [B, n], masks [B, n])``. Every row of every problem
    with the same features and the same classes is fitted in one ``fit_many(solver="rows")``
    call: each its own L-BFGS, one matrix product per step for all of them. (Folds are not
    started from the fit on every row: that fit has seen the fold's held-out rows, and a fold
    stopped before convergence would remember them.) Returns one list of B fitted probes (or
    constants) per problem.
    """
    fitted: list[list] = [[None] * len(labels) for _, labels, _ in problems]
    groups: dict = {}  # (features, classes) -> [(problem, row)]
    for i, (features, labels, masks) in enumerate(problems):
        for b in range(len(labels)):
            values = torch.unique(labels[b][masks[b]])
            if len(values) < 2:
                fitted[i][b] = _Constant(int(values[0]) if len(values) else -1)
            else:
                groups.setdefault((id(features), tuple(values.tolist())), []).append((i, b))
    eigen: dict = {}  # one eigenbasis per feature matrix, for every group reading it
    for members in groups.values():
        features = problems[members[0][0]][0]
        targets = torch.stack([problems[i][1][b] for i, b in members])
        masks = torch.stack([problems[i][2][b] for i, b in members])
        if id(features) not in eigen:
            eigen[id(features)] = feature_eigenbasis(features)
        models = clone_estimator(probe).fit_many(features, targets, masks, solver="rows",
                                                 eigenbasis=eigen[id(features)])
        for (i, b), model in zip(members, models):
            fitted[i][b] = model
    return fitted


def _logit(p: torch.Tensor) -> torch.Tensor:
    p = p.double().clamp(1e-6, 1 - 1e-6)
    return (p / (1 - p)).log()


def _rank(row: dict) -> tuple[float, float]:
    """How cross-validated rows are compared: out-of-fold AUROC, then balanced accuracy."""
    return float(np.nan_to_num(row["auroc"])), float(np.nan_to_num(row["balanced_accuracy"]))


def _selected_row(detector: "ErrorDetector") -> dict:
    """The cross-validated row of the method a fitted detector selected."""
    return next(r for r in detector.validation_ if r["method"] == detector.method_)


def _calibrator() -> MonotoneLogistic:
    """A logistic model from a method's features to P(correct) that can only rise with them (Platt
    scaling for one feature, stacking for several)."""
    return MonotoneLogistic(C=1.0)


class ErrorDetector(BaseEstimator):
    """Flags prompts the model answers wrongly, from its activations (Sun, Stolfo & Sachan 2025).

    Per answer slot (the position before each answer token; one slot per digit for single-token
    answers) ``probe`` is cloned and fitted to the true digit, the model's digit and — for
    addition written digit by digit — the carry the digit needs and the carry the model's digit
    implies (Quirke & Barez). The slot's activations are those of every layer in ``layers``
    concatenated ([d · n_layers] features). Three methods give P(correct) per prompt:

    * ``"disagreement"``: the probability that every slot's true-digit and output-digit probes
      agree (the paper's rule), calibrated;
    * ``"direct"``: a class-balanced binary probe on the slots' activations, calibrated;
    * ``"combined"``: a logistic model on every slot's log digit agreement, log carry agreement
      and the direct probe's logit (so one uncertain slot is weighed, not just "any slot
      disagrees").

    Every calibrator is a :class:`MonotoneLogistic`: P(correct) may only rise with its features,
    so a feature without signal is left out rather than turned around.

    ``fit`` scores all three by ``cv``-fold cross-validation (out-of-fold features, stratified by
    correctness, shuffled with ``random_state``), calibrates each on its out-of-fold scores and
    picks the method with the best out-of-fold AUROC (``method="auto"``). The threshold on
    P(correct) comes from the out-of-fold scores by :func:`best_threshold`: ``"balanced"``
    (default: the best balanced accuracy, so a rare class — the errors of a good model, the
    correct answers of a weak one — is not traded away for accuracy), ``"auto"`` (the most errors
    caught within one point of the best accuracy), ``"accuracy"``, or a fixed probability. The
    cross-validated rows in ``validation_`` threshold each fold where the other folds put it.

    ``layers="auto"`` (default) chooses what is read by the same cross-validation, on the
    training prompts only: every layer on its own and, when the direct probe then reads at most
    :data:`JOINT_MAX_FEATURES` features, every layer side by side; the candidate whose selected
    method has the best out-of-fold AUROC is kept. Every candidate's scores are in
    ``meta_["layer_search"]``. A detector whose cross-validated balanced accuracy is not above
    0.5 (what always predicting either outcome scores) by more than its 95% interval, widened
    for the number of methods and layer sets compared (Bonferroni), warns
    (:class:`DetectorBaselineWarning`, naming the layers and positions tried) and says so in
    ``meta_["beats_majority_baseline"]``.

    ``truth="answer"`` (default) lets the true-digit and true-carry probes read every answer slot
    side by side: a later position still holds what decides an earlier digit (the units sum that
    sets the tens carry), so an answer is checked once it is written; ``truth="slot"`` reads only
    the slot itself, as the paper does (a check before the digit is emitted).

    Parameters: ``probe`` a classifier estimator (``fit``, ``predict_proba``, ``classes_``, or a
    :class:`CircularProbe`), cloned per target (default ``LogisticProbe(C=0.05)``); ``layers``
    ``"auto"`` (chosen as above), None (every layer side by side), an int or a list;
    ``position`` ``"final"`` (slot j read at the final prompt token + j with the model's own
    answer fed back) or ``"final_only"`` (every slot at the final prompt token, before anything is
    emitted); ``carries`` adds the carry probes when the prompts allow them; ``solver`` (for the
    default :class:`LogisticProbe`) ``"batched"`` fits every probe of a feature set, folds
    included, in one vectorised L-BFGS with its own path and stopping per probe
    (:func:`~arithinterp.probes.estimators.lbfgs_rows`), or ``"per-target"`` one joint L-BFGS per
    target and its folds (the earlier path). Other probes are fitted one target at a time either
    way.
    """

    def __init__(self, probe: Any = None, layers: Union[None, str, int, Sequence[int]] = "auto",
                 site: str = "resid_post", position: str = "final", method: str = "auto",
                 threshold: Union[str, float] = "balanced",
                 cv: int = 5, carries: bool = True, truth: str = "answer", random_state: Optional[int] = 0,
                 batch_size: int = 256, progress: bool = False, solver: str = "batched"):
        self.probe = probe
        self.layers = layers
        self.site = site
        self.position = position
        self.method = method
        self.threshold = threshold
        self.cv = cv
        self.carries = carries
        self.truth = truth
        self.random_state = random_state
        self.batch_size = batch_size
        self.progress = progress
        self.solver = solver

    # -- parameters (checked when fitting, scikit-learn style) -----------------------------------

    def _check_params(self) -> Any:
        """Validate the constructor arguments; returns the probe to clone."""
        if self.method not in DETECTOR_METHODS + ("auto",):
            raise ConfigError(f"unknown method {self.method!r}; accepted: {accepted(DETECTOR_METHODS + ('auto',))}")
        if self.position not in DETECTOR_POSITIONS:
            raise ConfigError(f"unknown position {self.position!r}; accepted: {accepted(DETECTOR_POSITIONS)}")
        if not (isinstance(self.cv, (int, np.integer)) and self.cv >= 2):
            raise ConfigError(f"cv must be an integer >= 2 (folds), got {self.cv!r}")
        if self.solver not in DETECTOR_SOLVERS:
            raise ConfigError(f"unknown solver {self.solver!r}; accepted: {accepted(DETECTOR_SOLVERS)}")
        if self.truth not in ("answer", "slot"):
            raise ConfigError(f"truth must be 'answer' or 'slot' (what the true-value probes read), got {self.truth!r}")
        t = self.threshold
        if not (t in THRESHOLD_RULES or (isinstance(t, (int, float)) and not isinstance(t, bool) and 0 <= t <= 1)):
            raise ConfigError(
                f"threshold must be a probability in [0, 1] or one of {accepted(THRESHOLD_RULES)}, got {t!r}")
        if isinstance(self.layers, str) and self.layers != "auto":
            raise ConfigError(f"layers must be 'auto', None (every layer), a layer index or a list of them, "
                              f"got {self.layers!r}")
        site_lib.check_site(self.site)
        probe = LogisticProbe(C=0.05) if self.probe is None else self.probe
        classifier = isinstance(probe, CircularProbe) or (hasattr(probe, "predict_proba")
                                                          and not isinstance(probe, RidgeProbe))
        if not (hasattr(probe, "fit") and hasattr(probe, "get_params") and classifier):
            raise ConfigError(
                f"probe must be a classifier estimator with fit / predict_proba (e.g. LogisticProbe(), MLPProbe(), "
                f"CircularProbe() or a scikit-learn classifier), got {type(probe).__name__}"
            )
        return probe

    def _layer_list(self, model: Any) -> list[int]:
        """The layers ``fit`` reads: every layer for ``"auto"`` (the search picks among them)."""
        if self.layers is None or isinstance(self.layers, str):  # None, "auto" (other strings are refused)
            return site_lib.check_layers(model, self.site, None)
        layers = [self.layers] if isinstance(self.layers, (int, np.integer)) else self.layers
        return site_lib.check_layers(model, self.site, list(layers))

    # -- model-facing ----------------------------------------------------------------------------

    def _read(self, model: Any, prompts: Any, evaluation: Any, layers) -> tuple[torch.Tensor, Any]:
        """Slot activations ``[N, L, S, d]`` and the evaluation they were read under (by default
        :func:`model_answers`: generated once per prompt set)."""
        offsets = _slot_offsets(prompts, self.position)
        evaluation = evaluation if evaluation is not None else model_answers(model, prompts, self.batch_size)
        acts = _shared_prefix_slots(model, prompts, evaluation, self.site, layers, self.batch_size)
        if acts is None:
            acts = answer_activations(model, prompts, evaluation, self.site, layers, self.batch_size,
                                      self.progress).data[self.site]
        return acts.flatten(3)[:, :, offsets], evaluation

    def _labels(self, prompts: Any, evaluation: Any) -> tuple[dict, Optional[dict]]:
        slots = answer_slots(prompts, evaluation)
        return slots, (answer_carries(prompts, slots) if self.carries else None)

    def fit(self, model: HookedModel, prompts: PromptSet, evaluation: Optional[Evaluation] = None) -> "ErrorDetector":
        """Evaluate the model on ``prompts`` (or use ``evaluation``), read its activations, fit."""
        check_belongs(model, "ErrorDetector.fit", prompts=prompts)
        self._check_params()
        layers = self._layer_list(model)
        X, evaluation = self._read(model, prompts, evaluation, layers)
        slots, carries = self._labels(prompts, evaluation)
        self.fit_activations(X, slots, carries=carries, layers=layers)
        self.meta_.update(build_meta(model, n_fit_prompts=len(prompts), task=getattr(prompts, "template", None)))
        return self

    def evaluate(
        self, model: HookedModel, prompts: PromptSet, evaluation: Optional[Evaluation] = None
    ) -> "DetectorResult":
        """Detection metrics on (held-out) ``prompts`` for every method → :class:`DetectorResult`."""
        check_belongs(model, "ErrorDetector.evaluate", prompts=prompts, detector=self)
        self._check_fitted()
        X, evaluation = self._read(model, prompts, evaluation, self.layers_)
        slots, carries = self._labels(prompts, evaluation)
        result = self.evaluate_activations(X, slots, carries)
        return replace(result, meta={**result.meta, **build_meta(model, n_prompts=len(prompts))})

    def predict_proba(
        self, model: HookedModel, prompts: PromptSet, evaluation: Optional[Evaluation] = None
    ) -> torch.Tensor:
        """Calibrated P(correct) [N] of the selected method."""
        check_belongs(model, "ErrorDetector.predict_proba", prompts=prompts, detector=self)
        self._check_fitted()
        X, _ = self._read(model, prompts, evaluation, self.layers_)
        return self.predict_proba_activations(X, answer_slot_mask(prompts, X.shape[2]))

    def flag(
        self, model: HookedModel, prompts: PromptSet, evaluation: Optional[Evaluation] = None,
        budget: Optional[float] = None,
    ) -> torch.Tensor:
        """BoolTensor [N]: prompts predicted wrong — below the threshold, or with ``budget`` the
        riskiest ``ceil(budget · N)`` (e.g. ``budget=0.1`` flags the 10% least likely correct)."""
        proba = self.predict_proba(model, prompts, evaluation)
        return self._flags(proba, budget)

    def score(self, model: HookedModel, prompts: PromptSet, evaluation: Optional[Evaluation] = None) -> float:
        """Balanced accuracy of the flags on ``prompts`` (scikit-learn's ``score``)."""
        return self.evaluate(model, prompts, evaluation)["balanced_accuracy"]

    def answer_confidence(self, model: HookedModel, prompts: PromptSet, evaluation: Evaluation) -> torch.Tensor:
        """How much the true-digit and true-carry probes believe the answer in ``evaluation`` [N]:
        the product over slots of the probability they give to its digits and carries, read with
        that answer fed back. Compares candidate answers to the same prompts (``repair``)."""
        check_belongs(model, "ErrorDetector.answer_confidence", prompts=prompts, detector=self)
        self._check_fitted()
        X, evaluation = self._read(model, prompts, evaluation, self.layers_)
        slots, carries = self._labels(prompts, evaluation)
        return self.answer_confidence_activations(X, slots, carries)

    # -- tensor-facing ---------------------------------------------------------------------------

    def fit_activations(self, X: torch.Tensor, slots: dict, carries: Optional[dict] = None,
                        layers: Optional[Sequence[int]] = None) -> "ErrorDetector":
        """Fit from slot activations ``X`` [N, L, S, d], :func:`answer_slots` labels and
        (optionally) :func:`answer_carries` labels. ``layers`` names axis 1 (default ``0..L-1``);
        with ``layers="auto"`` in the constructor the detector is fitted on each candidate set of
        them (:meth:`layer_candidates`) and the best by out-of-fold AUROC is kept."""
        probe = self._check_params()
        X = self._check_X(X, slots)
        names = list(range(X.shape[1])) if layers is None else [int(layer) for layer in layers]
        if len(names) != X.shape[1]:
            raise AnalysisError(f"layers names {len(names)} layers but X has {X.shape[1]} on axis 1")
        correct = slots["correct"].bool()
        n_wrong, n_right = int((~correct).sum()), int(correct.sum())
        if min(n_wrong, n_right) < self.cv:
            raise AnalysisError(
                f"error detection with cv={self.cv} folds needs at least {self.cv} correct and {self.cv} wrong "
                f"answers; got {n_right} correct and {n_wrong} wrong (use more prompts, fewer folds or a model "
                "that still errs)"
            )
        carries = self._check_carries(carries, slots) if self.carries else None
        distinct = sum(not any(torch.equal(X[:, 0, s], X[:, 0, t]) for t in range(s)) for s in range(X.shape[2]))
        candidates = self.layer_candidates(names, distinct, X.shape[3]) if self.layers == "auto" else [names]
        search, fitted = [], None
        for chosen in candidates:
            columns = [names.index(layer) for layer in chosen]
            detector = self if len(candidates) == 1 else clone_estimator(self).set_params(layers=list(chosen))
            detector._fit_layers(probe, X[:, columns], slots, carries, chosen)
            row = _selected_row(detector)
            search.append(dict(layers=list(chosen), method=detector.method_,
                               **{k: row[k] for k in ("auroc", "balanced_accuracy", "balanced_accuracy_low",
                                                      "accuracy", "majority_baseline")}))
            if fitted is None or _rank(row) > _rank(_selected_row(fitted)):
                fitted = detector
        assert fitted is not None
        self.fit_layers_ = names  # what axis 1 held at fit: the tensor-facing methods take X like it, too
        if fitted is not self:  # keep the chosen candidate's fitted state
            for key, value in vars(fitted).items():
                if key.endswith("_") and not key.startswith("_"):
                    setattr(self, key, value)
        self._finish(probe, carries is not None, n_wrong, len(correct), search, len(candidates) > 1)
        return self

    @staticmethod
    def layer_candidates(layers: Sequence[int], n_slots: int, width: int) -> list[list[int]]:
        """What ``layers="auto"`` tries: every layer on its own, then (for several layers) all of
        them side by side when the direct probe would read at most :data:`JOINT_MAX_FEATURES`
        features (``n_slots`` distinct slots x layers x ``width``): a probe over many more
        features than there are prompts overfits, and its fit grows with their cube.

        Args:
            layers: the layers read (axis 1 of the slot activations).
            n_slots: distinct answer slots (slots read at one position count once).
            width: features per slot and layer (``d_model`` for ``resid_post``).

        Returns:
            The candidate layer lists, singles first.
        """
        singles = [[int(layer)] for layer in layers]
        if len(layers) > 1 and n_slots * len(layers) * width <= JOINT_MAX_FEATURES:
            return singles + [[int(layer) for layer in layers]]
        return singles

    def _fit_layers(self, probe: Any, X: torch.Tensor, slots: dict, carries: Optional[dict],
                    layers: Sequence[int]) -> None:
        """Fit every probe, calibrator and threshold on ``X`` [N, L, S, d] (the layers ``layers``);
        sets the fitted attributes except ``meta_``."""
        self.layers_ = [int(layer) for layer in layers]
        correct = slots["correct"].bool()
        Xs = X.permute(0, 2, 1, 3).flatten(2)  # [N, S, L·d]: the chosen layers side by side
        # slots read at the same position share one activation: the direct probe sees each once
        self.direct_slots_ = [s for s in range(Xs.shape[1])
                              if not any(torch.equal(Xs[:, s], Xs[:, t]) for t in range(s))]
        self.n_slots_, self.n_features_ = Xs.shape[1], Xs.shape[2]
        from sklearn.model_selection import StratifiedKFold

        folds = list(StratifiedKFold(self.cv, shuffle=True, random_state=self.random_state).split(
            np.zeros(len(correct)), correct.numpy()))
        train = torch.zeros(len(folds) + 1, len(correct), dtype=torch.bool)  # the folds' training rows, then all
        for f, (rows, _) in enumerate(folds):
            train[f, rows] = True
        train[-1] = True

        # slot probes: each target fitted on every fold and on all rows; agreements scored out of fold
        self.slot_targets_ = self._targets(slots, carries)
        self.slot_probes_ = []
        n = len(correct)
        agree = {name: torch.ones(n, self.n_slots_) for name in ("digit", "carry")}
        Xd = Xs[:, self.direct_slots_].flatten(1)  # every distinct slot, side by side [N, S'·L·d]
        slot_features = [Xs[:, s].contiguous() for s in range(self.n_slots_)]
        keys, problems = [], []
        for s in range(self.n_slots_):
            for name, labels, mask in self.slot_targets_[s]:
                features = Xd if (self.truth == "answer" and name.startswith("true")) else slot_features[s]
                keys.append((s, name))
                problems.append((features, labels.expand(len(train), -1), mask & train))
        direct_probe = self._direct_probe(probe)
        direct_problem = (Xd, correct.long().expand(len(train), -1), train)
        if self.solver == "batched" and type(probe) is LogisticProbe:
            fits = dict(zip(keys, _fit_batched(probe, problems)))
            fitted = _fit_batched(direct_probe, [direct_problem])[0]
        else:
            fits = {key: _fit_problems(probe, *problem) for key, problem in zip(keys, problems)}
            fitted = _fit_problems(direct_probe, *direct_problem)
        for s in range(self.n_slots_):
            by_target = {name: fits[s, name] for name, _, _ in self.slot_targets_[s]}
            self.slot_probes_.append({name: models[-1] for name, models in by_target.items()})
            for f, (_, rows) in enumerate(folds):
                rows = torch.as_tensor(rows)
                for kind in ("digit", "carry"):
                    if f"true_{kind}" in by_target:
                        agree[kind][rows, s] = self._agree(by_target[f"true_{kind}"][f], by_target[f"output_{kind}"][f],
                                                           Xs[rows, s], Xd[rows])
        # the direct probe, class-balanced
        self.direct_probe_ = fitted[-1]
        direct = torch.empty(n)
        for f, (_, rows) in enumerate(folds):
            direct[rows] = self._p_correct(fitted[f], Xd[torch.as_tensor(rows)])

        # per method: out-of-fold features → calibrated out-of-fold P(correct), threshold, scores
        valid = slots["valid"]
        features = self._method_features(agree, direct, valid, fit=True)
        from sklearn.model_selection import cross_val_predict

        y = correct.numpy()
        self.calibrators_, self.thresholds_, self.validation_ = {}, {}, []
        oof = {}
        rule = self.threshold
        for method in DETECTOR_METHODS:
            F = features[method]
            proba = np.asarray(cross_val_predict(_calibrator(), F, y, cv=folds, method="predict_proba"))
            oof[method] = torch.as_tensor(proba[:, 1])
            self.calibrators_[method] = _calibrator().fit(F, y)
            threshold = best_threshold(correct, oof[method], rule) if isinstance(rule, str) else float(rule)
            self.thresholds_[method] = threshold
            # each fold thresholded where the other folds put it: the rows scored never chose it
            row = detection_metrics(correct, fold_predictions(correct, oof[method], folds, rule), oof[method])
            self.validation_.append(dict(method=method, threshold=threshold, **row))
        candidates = [r for r in self.validation_ if self.method in ("auto", r["method"])]
        self.method_ = max(candidates, key=_rank)["method"]
        self.oof_proba_ = oof[self.method_]

    def _finish(self, probe: Any, carries: bool, n_wrong: int, n: int, search: list, searched: bool) -> None:
        """``meta_`` of the fitted detector, and the warning when it does not beat chance."""
        best = _selected_row(self)
        # the selected row is the best of every method and layer candidate compared: its interval is
        # widened for that many comparisons (Bonferroni), so a search over noise does not pass
        compared = (len(DETECTOR_METHODS) if self.method == "auto" else 1) * len(search)
        z = statistics.NormalDist().inv_cdf(1 - 0.025 / compared)
        se = (best["balanced_accuracy"] - best["balanced_accuracy_low"]) / Z_95
        bound = best["balanced_accuracy"] - z * se
        beats = bool(bound > 0.5)
        where = self._where()
        self.meta_ = build_meta(
            method=self.method_, method_choice="best out-of-fold AUROC" if self.method == "auto" else "fixed",
            threshold=self.thresholds_[self.method_], threshold_rule=self.threshold, cv=self.cv, layers=self.layers_,
            layer_choice="best out-of-fold AUROC" if searched else "fixed", layer_search=search,
            site=self.site, position=self.position, positions_read=where, probe=repr(probe), carries=carries,
            random_state=self.random_state, n_fit=n, n_fit_errors=n_wrong,
            validation={r["method"]: {k: r[k] for k in ("balanced_accuracy", "balanced_accuracy_low",
                                                         "balanced_accuracy_high", "accuracy", "majority_baseline",
                                                         "auroc", "error_precision", "error_recall")}
                        for r in self.validation_},
            chance_bound=float(bound), compared=compared,
            beats_majority_baseline=beats, beats_majority_accuracy=bool(best["accuracy"] > best["majority_baseline"]),
        )
        if not beats:
            tried = ", ".join(str(r["layers"]) for r in search)
            warnings.warn(
                f"the error detector does not beat always predicting the majority class: its cross-validated "
                f"balanced accuracy ({best['balanced_accuracy']:.3f}, {self.method_}; the lower end of its 95% "
                f"interval, widened for the {compared} methods and layer sets compared, is {bound:.3f}) is not above "
                f"the 0.5 that always answering 'correct' or 'wrong' "
                f"scores (accuracy {best['accuracy']:.3f} against the majority's {best['majority_baseline']:.3f}, "
                f"out-of-fold AUROC {best['auroc']:.3f}); tried {self.site} at layers {tried}, read at {where}; "
                "its flags are not worth acting on",
                DetectorBaselineWarning, stacklevel=3,
            )

    def _where(self) -> str:
        """The positions the slots are read at, in words."""
        if self.position == "final_only" or self.n_slots_ == 1:
            return "the final prompt token"
        return f"the position before each of the {self.n_slots_} answer tokens (the model's own answer fed back)"

    def predict_proba_activations(self, X: torch.Tensor, valid: Optional[torch.Tensor] = None,
                                  method: Optional[str] = None) -> torch.Tensor:
        """Calibrated P(correct) [N] from slot activations ``X`` [N, L, S, d] (the fitted layers);
        ``valid`` [N, S] marks existing slots; ``method`` defaults to the selected one."""
        return self._all_proba(X, valid)[method or self.method_]

    def flag_activations(self, X: torch.Tensor, valid: Optional[torch.Tensor] = None,
                         budget: Optional[float] = None) -> torch.Tensor:
        """Flags [N] from slot activations ``X`` [N, L, S, d] (see :meth:`flag`)."""
        return self._flags(self.predict_proba_activations(X, valid), budget)

    def evaluate_activations(self, X: torch.Tensor, slots: dict, carries: Optional[dict] = None) -> "DetectorResult":
        """Metrics from slot activations ``X`` [N, L, S, d] and their labels → :class:`DetectorResult`."""
        self._check_fitted()
        X = self._chosen_layers(self._check_X(X, slots))
        probas = self._all_proba(X, slots["valid"])
        scores = torch.stack([probas[m] for m in DETECTOR_METHODS], 1)
        predicted = torch.stack([probas[m] >= self.thresholds_[m] for m in DETECTOR_METHODS], 1)
        Xs = X.permute(0, 2, 1, 3).flatten(2)
        pred_true = torch.stack([torch.as_tensor(np.asarray(p["true_digit"].predict(self._truth_X(Xs, s)))).long()
                                 for s, p in enumerate(self.slot_probes_)], 1)
        pred_output = torch.stack([torch.as_tensor(np.asarray(p["output_digit"].predict(Xs[:, s]))).long()
                                   for s, p in enumerate(self.slot_probes_)], 1)
        return DetectorResult(
            correct=slots["correct"].bool(), scores=scores, predicted_correct=predicted, methods=list(DETECTOR_METHODS),
            method=self.method_, layers=list(self.layers_), position=self.position, true_slots=slots["true"],
            output_slots=slots["output"], slot_valid=slots["valid"], pred_true_slots=pred_true,
            pred_output_slots=pred_output, validation=list(self.validation_),
            meta=dict(self.meta_),
        )

    def answer_confidence_activations(
        self, X: torch.Tensor, slots: dict, carries: Optional[dict] = None
    ) -> torch.Tensor:
        """:meth:`answer_confidence` from activations ``X`` [N, L, S, d] read with the answer fed
        back and its labels (``slots["output"]`` / ``carries["output"]`` are the answer's)."""
        self._check_fitted()
        X = self._chosen_layers(self._check_X(X, slots))
        Xs = X.permute(0, 2, 1, 3).flatten(2)
        confidence = torch.ones(len(X))
        for s, probes in enumerate(self.slot_probes_):
            p = _likelihood(probes["true_digit"], self._truth_X(Xs, s), slots["output"][:, s])
            confidence *= torch.where(slots["valid"][:, s], p, 1.0)
            if "true_carry" in probes and carries is not None:
                p = _likelihood(probes["true_carry"], self._truth_X(Xs, s), carries["output"][:, s])
                confidence *= torch.where(carries["valid"][:, s], p, 1.0)
        return confidence

    # -- internals -------------------------------------------------------------------------------

    def _chosen_layers(self, X: torch.Tensor) -> torch.Tensor:
        """``X`` [N, L, S, d] with the layers the detector reads: X holds just those (``layers_``),
        or every layer it was fitted from (``fit_layers_``, e.g. all of them with ``layers="auto"``)."""
        if X.ndim == 4 and X.shape[1] != len(self.layers_) and X.shape[1] == len(getattr(self, "fit_layers_", ())):
            return X[:, [self.fit_layers_.index(layer) for layer in self.layers_]]
        return X

    def _check_fitted(self) -> None:
        if not hasattr(self, "calibrators_"):
            raise NotFittedError("this ErrorDetector is not fitted yet; call fit(model, prompts) first")

    def _flags(self, proba: torch.Tensor, budget: Optional[float]) -> torch.Tensor:
        return _budget_flags(proba, budget) if budget is not None else proba < self.thresholds_[self.method_]

    @staticmethod
    def _check_X(X: torch.Tensor, slots: dict) -> torch.Tensor:
        X = to_tensor(X, "X").float()
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

    @staticmethod
    def _check_carries(carries: Optional[dict], slots: dict) -> Optional[dict]:
        if carries is None:
            return None
        for key in ("true", "output", "valid"):
            if key not in carries or tuple(carries[key].shape) != tuple(slots["true"].shape):
                raise AnalysisError("carries must hold 'true', 'output' and 'valid' [N, S] like the slots; "
                                    "build them with answer_carries(prompts, slots)")
        return carries

    @staticmethod
    def _targets(slots: dict, carries: Optional[dict]) -> list[list]:
        """Per slot: ``(name, labels [N], rows [N])`` of every probe target."""
        per_slot = []
        for s in range(slots["true"].shape[1]):
            valid = slots["valid"][:, s]
            targets = [("true_digit", slots["true"][:, s], valid), ("output_digit", slots["output"][:, s], valid)]
            if carries is not None and carries["valid"][:, s].any():
                rows = carries["valid"][:, s]
                targets += [("true_carry", carries["true"][:, s], rows),
                            ("output_carry", carries["output"][:, s], rows)]
            per_slot.append(targets)
        return per_slot

    def _truth_X(self, Xs: torch.Tensor, s: int) -> torch.Tensor:
        """What the true-value probes of slot ``s`` read: the slot [N, L·d] or the answer [N, S'·L·d]."""
        return Xs[:, self.direct_slots_].flatten(1) if self.truth == "answer" else Xs[:, s]

    def _agree(self, true_probe: Any, output_probe: Any, X_slot: torch.Tensor, X_answer: torch.Tensor) -> torch.Tensor:
        """:func:`_agreement` with the true-value probe reading ``truth`` (its slot or the answer)."""
        p_true, c_true = _class_probs(true_probe, X_answer if self.truth == "answer" else X_slot)
        p_out, c_out = _class_probs(output_probe, X_slot)
        return ((p_true @ (c_true[:, None] == c_out[None, :]).float()) * p_out).sum(-1)

    def _direct_probe(self, probe: Any) -> Any:
        if isinstance(probe, CircularProbe):  # an angle cannot tell two classes apart: a logistic probe does
            probe = LogisticProbe(C=0.05)
        probe = clone_estimator(probe)
        if "class_weight" in probe.get_params():
            probe.set_params(class_weight="balanced")
        return probe

    @staticmethod
    def _p_correct(probe: Any, X: torch.Tensor) -> torch.Tensor:
        probs, classes = _class_probs(probe, X)
        return (probs * (classes == 1).float()[None, :]).sum(-1)

    def _method_features(self, agree: dict, direct: torch.Tensor, valid: torch.Tensor, fit: bool = False) -> dict:
        """Each method's calibrator input: ``disagreement`` [N, 1] (log P(every slot agrees)),
        ``direct`` [N, 1] (logit), ``combined`` [N, F] (per-slot log agreements and the logit)."""
        log_digit = torch.where(valid, agree["digit"].clamp_min(1e-6).log(), 0.0)
        log_carry = torch.where(valid, agree["carry"].clamp_min(1e-6).log(), 0.0)
        combined = torch.cat([log_digit, log_carry, _logit(direct)[:, None].float()], 1)
        if fit:  # columns that never vary (a slot the model never gets wrong) carry nothing
            self.combined_columns_ = (combined.std(0) > 1e-6).nonzero()[:, 0].tolist()
        return dict(
            disagreement=log_digit.sum(1, keepdim=True).double().numpy(),
            direct=_logit(direct)[:, None].numpy(),
            combined=combined[:, self.combined_columns_].double().numpy(),
        )

    def _all_proba(self, X: torch.Tensor, valid: Optional[torch.Tensor]) -> dict:
        """Calibrated P(correct) [N] of every method from ``X`` [N, L, S, d]."""
        self._check_fitted()
        X = self._chosen_layers(to_tensor(X, "X").float())
        expected = (len(self.layers_), self.n_slots_, self.n_features_ // len(self.layers_))
        if X.ndim != 4 or tuple(X.shape[1:]) != expected:
            raise AnalysisError(f"X must be [n_prompts, {expected[0]} layers, {expected[1]} slots, {expected[2]}], "
                                f"got shape {tuple(X.shape)}")
        valid = torch.ones(X.shape[0], X.shape[2], dtype=torch.bool) if valid is None else valid.bool()
        Xs = X.permute(0, 2, 1, 3).flatten(2)
        Xd = Xs[:, self.direct_slots_].flatten(1)
        agree = {name: torch.ones(len(X), self.n_slots_) for name in ("digit", "carry")}
        for s, probes in enumerate(self.slot_probes_):
            for kind in ("digit", "carry"):
                if f"true_{kind}" in probes:
                    agree[kind][:, s] = self._agree(probes[f"true_{kind}"], probes[f"output_{kind}"], Xs[:, s], Xd)
        direct = self._p_correct(self.direct_probe_, Xd)
        features = self._method_features(agree, direct, valid)
        return {m: torch.as_tensor(self.calibrators_[m].predict_proba(features[m])[:, 1]).float()
                for m in DETECTOR_METHODS}


@dataclass(frozen=True)
class DetectorResult(Result):
    """An :class:`ErrorDetector` on a prompt set: per-prompt scores and metrics for each method.

    ``correct`` [N] (the truth), ``scores`` [N, M] (calibrated P(correct) per method in
    ``methods``), ``predicted_correct`` [N, M] (at each method's threshold); per answer slot
    [N, S]: ``true_slots``, ``output_slots``, ``slot_valid`` and the slot probes' predictions
    ``pred_true_slots`` / ``pred_output_slots``. ``method`` is the one ``flag`` uses;
    ``validation`` the cross-validated rows it was chosen by; ``layers`` the layers read.
    """

    correct: torch.Tensor
    scores: torch.Tensor
    predicted_correct: torch.Tensor
    methods: list
    method: str
    layers: list
    position: str
    true_slots: torch.Tensor
    output_slots: torch.Tensor
    slot_valid: torch.Tensor
    pred_true_slots: torch.Tensor
    pred_output_slots: torch.Tensor
    validation: list
    meta: dict

    # what load checks: the axes fields share and the values they may take
    _shapes = {"correct": "prompt", "scores": "prompt method", "predicted_correct": "prompt method",
               "methods": "method", "true_slots": "prompt slot", "output_slots": "prompt slot",
               "slot_valid": "prompt slot", "pred_true_slots": "prompt slot", "pred_output_slots": "prompt slot"}
    _legal = {"methods": DETECTOR_METHODS, "method": DETECTOR_METHODS, "position": DETECTOR_POSITIONS,
              "layers": NON_NEGATIVE}

    def _index(self, method: Optional[str]) -> int:
        method = self.method if method is None else method
        if method not in self.methods:
            raise AnalysisError(f"unknown method {method!r}; accepted: {accepted(self.methods)}")
        return self.methods.index(method)

    def metrics(self, method: Optional[str] = None) -> dict:
        """:func:`detection_metrics` for ``method`` (default: the selected one)."""
        m = self._index(method)
        return detection_metrics(self.correct, self.predicted_correct[:, m], self.scores[:, m])

    def at_budget(self, budget: float = 0.1, method: Optional[str] = None) -> dict:
        """Flag the riskiest ``ceil(budget · N)`` prompts: how many, and the error precision
        (flags that are errors) and recall (errors flagged) at that operating point."""
        m = self._index(method)
        flags = _budget_flags(self.scores[:, m], budget)
        wrong = ~self.correct
        return dict(budget=budget, flagged=int(flags.sum()),
                    error_precision=float((flags & wrong).sum() / max(int(flags.sum()), 1)),
                    error_recall=float((flags & wrong).sum() / max(int(wrong.sum()), 1)))

    def __getitem__(self, key: str) -> float:
        """A metric of the selected method, e.g. ``result["auroc"]``."""
        values = self.metrics()
        if key not in values:
            raise AnalysisError(f"unknown metric {key!r}; accepted: {accepted(values)}")
        return values[key]

    def finding(self, method: Optional[str] = None) -> dict:
        """The detector's result in words and numbers, against always answering one way.

        ``verdict`` is ``"finding"`` when balanced accuracy's 95% interval lies above 0.5 (what
        always answering "correct" or always "wrong" scores, whatever the error rate), else
        ``"no signal"``. ``text`` quotes balanced accuracy with its interval, AUROC, accuracy
        against the majority outcome's, the layers read and, from the fit, every layer set tried
        (compared out of fold on the fitting prompts) and the positions read.
        """
        m = self.metrics(method)
        tried = [r["layers"] for r in self.meta.get("layer_search", [])] or [list(self.layers)]
        where = self.meta.get("positions_read", self.position)
        site = self.meta.get("site", "resid_post")
        finding = bool(m["beats_chance"])
        quoted = (f"balanced accuracy {m['balanced_accuracy']:.2f} (95% CI {m['balanced_accuracy_low']:.2f} to "
                  f"{m['balanced_accuracy_high']:.2f}) on {m['n']} prompts ({m['n_errors']} wrong), AUROC "
                  f"{m['auroc']:.2f}, accuracy {m['accuracy']:.2f} against {m['majority_baseline']:.2f} for always "
                  f"answering '{'correct' if m['always_correct_accuracy'] >= 0.5 else 'wrong'}'")
        searched = (f"{site} at layers {', '.join(map(str, tried))} tried (out of fold on the fitting prompts), "
                    f"read at {where}")
        if finding:
            text = f"The error detector at layers {list(self.layers)} flags errors: {quoted}; {searched}."
        else:
            text = (f"No signal above always answering one way (balanced accuracy 0.5): {quoted}; {searched}; "
                    f"none beats it.")
        return dict(verdict="finding" if finding else "no signal", balanced_accuracy=m["balanced_accuracy"],
                    ci_low=m["balanced_accuracy_low"], ci_high=m["balanced_accuracy_high"], auroc=m["auroc"],
                    accuracy=m["accuracy"], majority_baseline=m["majority_baseline"], layers=list(self.layers),
                    layers_tried=tried, positions=where, text=text)

    def slot_accuracy(self) -> dict:
        """Held-out accuracy of the true-digit and output-digit probes per slot."""
        valid = self.slot_valid.float()
        hit_true = ((self.pred_true_slots == self.true_slots).float() * valid).sum(0) / valid.sum(0).clamp_min(1)
        hit_out = ((self.pred_output_slots == self.output_slots).float() * valid).sum(0) / valid.sum(0).clamp_min(1)
        return dict(true=hit_true.tolist(), output=hit_out.tolist())

    def to_frame(self, budget: float = 0.1):
        """One row per method: its metrics and the error precision / recall at ``budget``."""
        import pandas as pd

        rows = []
        for m in self.methods:
            at = self.at_budget(budget, m)
            rows.append(dict(method=m, selected=m == self.method, layers=",".join(map(str, self.layers)),
                             position=self.position, **self.metrics(m),
                             budget=budget, error_precision_at_budget=at["error_precision"],
                             error_recall_at_budget=at["error_recall"]))
        return pd.DataFrame(rows)

    def plot(self, kind: str = "roc", slot: int = 0, probe: str = "true", **kwargs):
        """``kind="roc"``: ROC curve per method; ``"calibration"``: reliability diagram (predicted
        P(correct) vs observed frequency); ``"confusion"``: predicted vs actual values of the
        ``probe`` (``"true"`` or ``"output"``) digit probe at ``slot``."""
        from arithinterp.viz import probes as viz

        if kind == "roc":
            return viz.plot_roc(self, **kwargs)
        if kind == "calibration":
            return viz.plot_calibration(self, **kwargs)
        if kind == "confusion":
            return viz.plot_digit_confusion(self, slot=slot, probe=probe, **kwargs)
        raise ConfigError(f"unknown plot kind {kind!r}; accepted: {accepted(('roc', 'calibration', 'confusion'))}")
