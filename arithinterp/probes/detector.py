# Over 600 lines on purpose: ErrorDetector is one scikit-learn estimator whose parameters, model-facing and
# tensor-facing methods share its fitted state; reading the slots, the slot probes, the fit on one layer set,
# the metrics and the result live in slots, slot_probes, detector_fit, operating_points and detector_result.
"""The probe-based error detector: flags prompts the model will answer wrongly.

Sun, Stolfo & Sachan 2025 (EMNLP) probe each answer digit twice — for the digit the model writes
and for the true digit — and flag an answer where the two disagree; they also fit a direct
correct-vs-wrong probe. :class:`ErrorDetector` fits both, adds carry probes (the carry a digit
needs against the carry the model's digit implies; the make-carry / sum-9 cascades of Quirke &
Barez 2023-24 are where small models fail), reads several layers at once, combines the per-slot
scores with a logistic model, calibrates every method and chooses method and threshold by
cross-validation inside ``fit``. :class:`~arithinterp.probes.DetectorResult` is its result on a
prompt set.

What the estimator stands on lives beside it: reading the answer slots (:mod:`~arithinterp.probes.slots`),
the slot probes and method features (:mod:`~arithinterp.probes.slot_probes`), the fit on one set
of layers (:mod:`~arithinterp.probes.detector_fit`), thresholds and metrics
(:mod:`~arithinterp.probes.operating_points`) and the result (:mod:`~arithinterp.probes.detector_result`).
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence, Union

import numpy as np
import torch
from sklearn.base import BaseEstimator

from arithinterp import sites as site_lib
from arithinterp.checks import check_belongs, fingerprint
from arithinterp.errors import AnalysisError, ModelMismatchError
from arithinterp.probes.answers import answer_activations, answer_slot_mask, answer_slots, slot_names
from arithinterp.probes.detector_fit import check_params, fit_candidate, fit_meta, rank, selected_row
from arithinterp.probes.detector_result import DetectorResult
from arithinterp.probes.probe_base import NotFittedError, clone_estimator, to_tensor
from arithinterp.probes.operating_points import budget_flags
from arithinterp.probes.slot_probes import DETECTOR_METHODS, agreement, likelihood, method_features, p_correct
from arithinterp.probes.slots import (
    answer_carries, check_carries, check_slot_activations, model_answers, shared_prefix_slots, slot_offsets,
)
from arithinterp.results import build_meta

if TYPE_CHECKING:
    from arithinterp.tasks import Evaluation
    from arithinterp.tasks import PromptSet
    from arithinterp.types import HookedModel

JOINT_MAX_FEATURES = 4096  # layers="auto" also tries all layers side by side up to this many direct-probe features


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

    Args:
        probe: a classifier estimator (``fit``, ``predict_proba``, ``classes_``, or a
            :class:`CircularProbe`), cloned per target (default ``LogisticProbe(C=0.05)``).
        layers: ``"auto"`` (chosen as above), None (every layer side by side), an int or a list.
        site: the site read (default ``"resid_post"``).
        position: ``"final"`` (slot j read at the final prompt token + j with the model's own
            answer fed back) or ``"final-only"`` (every slot at the final prompt token, before
            anything is emitted).
        method: ``"auto"`` (the best out-of-fold AUROC) or one of :data:`DETECTOR_METHODS`.
        threshold: a rule of :func:`best_threshold` or a fixed probability.
        cv: cross-validation folds (at least 2).
        carries: adds the carry probes when the prompts allow them.
        truth: ``"answer"`` or ``"slot"``, what the true-value probes read (see above).
        random_state: the seed of the folds.
        batch_size: prompts per forward when reading activations.
        progress: show progress bars.
        solver: (for the default :class:`LogisticProbe`) ``"batched"`` fits every probe of a
            feature set, folds included, in one vectorised L-BFGS with its own path and stopping
            per probe (:func:`~arithinterp.probes.lbfgs.lbfgs_rows`), or ``"per-target"`` one
            joint L-BFGS per target and its folds. Other probes are fitted one target at a time
            either way.
        max_seconds: with ``layers="auto"``, a time limit on the layer search: its candidates are
            tried coarse to fine over the depth (the last layer, the first, the middle, the
            quarters, ...: :func:`~arithinterp.sites.coarse_to_fine`; all layers side by side last)
            and no new one starts once this many seconds have passed since ``fit`` began (reading
            the activations included; the first candidate always runs). ``meta_["layer_search"]``
            holds the candidates tried,
            ``meta_["layer_candidates"]`` how many there were. ``None``: every candidate.
        max_candidates: with ``layers="auto"``, a limit on the layer search counted in candidates,
            so that where it stops does not depend on the machine: the first ``max_candidates`` of
            the coarse-to-fine order above are tried, and only their layers are read. ``None``:
            every candidate.
    """

    # the fitted state, set by fit (scikit-learn style: names ending in "_")
    layers_: list[int]
    fit_layers_: list[int]
    direct_slots_: list[int]
    n_slots_: int
    n_features_: int
    slot_targets_: list[list]
    slot_probes_: list[dict]
    direct_probe_: Any
    combined_columns_: list[int]
    calibrators_: dict
    thresholds_: dict[str, float]
    validation_: list[dict]
    method_: str
    oof_proba_: torch.Tensor
    meta_: dict

    def __init__(self, probe: Any = None, layers: Union[None, str, int, Sequence[int]] = "auto",
                 site: str = "resid_post", position: str = "final", method: str = "auto",
                 threshold: Union[str, float] = "balanced",
                 cv: int = 5, carries: bool = True, truth: str = "answer", random_state: Optional[int] = 0,
                 batch_size: int = 256, progress: bool = False, solver: str = "batched",
                 max_seconds: Optional[float] = None, max_candidates: Optional[int] = None):
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
        self.max_seconds = max_seconds
        self.max_candidates = max_candidates

    def _layer_list(self, model: Any) -> list[int]:
        """The layers ``fit`` reads: every layer for ``"auto"`` (the search picks among them), or
        with ``max_candidates`` the layers of the candidates it will try."""
        if self.layers is None or isinstance(self.layers, str):  # None, "auto" (other strings are refused)
            every = site_lib.check_layers(model, self.site, None)
            if self.layers == "auto" and self.max_candidates is not None and self.max_candidates < len(every):
                return sorted(site_lib.coarse_to_fine(every)[: self.max_candidates])
            return every
        layers = [self.layers] if isinstance(self.layers, (int, np.integer)) else self.layers
        return site_lib.check_layers(model, self.site, list(layers))

    # -- model-facing ----------------------------------------------------------------------------

    def _read(self, model: Any, prompts: Any, evaluation: Any, layers) -> tuple[torch.Tensor, Any]:
        """Slot activations ``[N, L, S, d]`` and the evaluation they were read under (by default
        :func:`model_answers`: generated once per prompt set)."""
        offsets = slot_offsets(prompts, self.position)
        evaluation = evaluation if evaluation is not None else model_answers(model, prompts, self.batch_size)
        acts = shared_prefix_slots(model, prompts, evaluation, self.site, layers, self.batch_size)
        if acts is None:
            acts = answer_activations(model, prompts, evaluation, self.site, layers=layers, batch_size=self.batch_size,
                                      progress=self.progress).data[self.site]
        return acts.flatten(3)[:, :, offsets], evaluation

    def _labels(self, prompts: Any, evaluation: Any) -> tuple[dict, Optional[dict]]:
        slots = answer_slots(prompts, evaluation)
        return slots, (answer_carries(prompts, slots) if self.carries else None)

    def fit(self, model: HookedModel, prompts: PromptSet, evaluation: Optional[Evaluation] = None) -> "ErrorDetector":
        """Evaluate the model on ``prompts`` (or use ``evaluation``), read its activations, fit.

        Args:
            model: The hooked model.
            prompts: The fitting prompts (at least ``cv`` right and ``cv`` wrong answers).
            evaluation: ``prompts.evaluate(model)``; ``None`` generates it (once per prompt set).

        Returns:
            The detector, fitted.

        Raises:
            ConfigError: a constructor argument is refused.
            AnalysisError: too few right or wrong answers for ``cv`` folds.
            ModelMismatchError: the prompts were built for another model.
        """
        check_belongs(model, "ErrorDetector.fit", prompts=prompts)
        check_params(self)
        started = time.perf_counter()  # max_seconds counts the reading, too
        layers = self._layer_list(model)
        X, evaluation = self._read(model, prompts, evaluation, layers)
        slots, carries = self._labels(prompts, evaluation)
        self._fit_activations(X, slots, carries, layers, started)
        self.meta_.update(build_meta(model, n_fit_prompts=len(prompts), task=getattr(prompts, "template", None)),
                          slots=slot_names(prompts))
        return self

    def evaluate(
        self, model: HookedModel, prompts: PromptSet, evaluation: Optional[Evaluation] = None
    ) -> "DetectorResult":
        """Detection metrics on (held-out) ``prompts`` for every method.

        Args:
            model: The hooked model the detector was fitted on.
            prompts: The (held-out) prompts.
            evaluation: ``prompts.evaluate(model)``; ``None`` generates it.

        Returns:
            Per-prompt scores and calls of every method, and the slot probes' predictions.

        Raises:
            NotFittedError: the detector is not fitted.
            ModelMismatchError: the prompts or the detector belong to another model.
        """
        check_belongs(model, "ErrorDetector.evaluate", prompts=prompts, detector=self)
        self._check_fitted()
        X, evaluation = self._read(model, prompts, evaluation, self.layers_)
        slots, carries = self._labels(prompts, evaluation)
        result = self.evaluate_activations(X, slots, carries)
        return replace(result, meta={**result.meta, **build_meta(model, n_prompts=len(prompts)),
                                     "slots": slot_names(prompts)})

    def predict_proba(
        self, model: HookedModel, prompts: PromptSet, evaluation: Optional[Evaluation] = None
    ) -> torch.Tensor:
        """Calibrated P(correct) of the selected method.

        Args:
            model: The hooked model the detector was fitted on.
            prompts: The prompts (N of them).
            evaluation: ``prompts.evaluate(model)``; ``None`` generates it.

        Returns:
            P(correct), float [N].

        Raises:
            NotFittedError: the detector is not fitted.
            ModelMismatchError: the prompts or the detector belong to another model.
        """
        check_belongs(model, "ErrorDetector.predict_proba", prompts=prompts, detector=self)
        self._check_fitted()
        X, _ = self._read(model, prompts, evaluation, self.layers_)
        return self.predict_proba_activations(X, answer_slot_mask(prompts, X.shape[2]))

    def flag(
        self, model: HookedModel, prompts: PromptSet, evaluation: Optional[Evaluation] = None,
        budget: Optional[float] = None,
    ) -> torch.Tensor:
        """Prompts predicted wrong: below the threshold, or with ``budget`` the riskiest
        ``ceil(budget · N)`` (e.g. ``budget=0.1`` flags the 10% least likely correct).

        Args:
            model: The hooked model the detector was fitted on.
            prompts: The prompts (N of them).
            evaluation: ``prompts.evaluate(model)``; ``None`` generates it.
            budget: The fraction of prompts to flag, in (0, 1]; ``None`` uses the threshold.

        Returns:
            BoolTensor [N], True for a flagged prompt.

        Raises:
            NotFittedError: the detector is not fitted.
            ConfigError: ``budget`` is not a fraction in (0, 1].
        """
        proba = self.predict_proba(model, prompts, evaluation)
        return self._flags(proba, budget)

    def score(self, model: HookedModel, prompts: PromptSet, evaluation: Optional[Evaluation] = None) -> float:
        """Balanced accuracy of the flags on ``prompts`` (scikit-learn's ``score``).

        Args:
            model: The hooked model the detector was fitted on.
            prompts: The (held-out) prompts.
            evaluation: ``prompts.evaluate(model)``; ``None`` generates it.

        Returns:
            The selected method's balanced accuracy.
        """
        return self.evaluate(model, prompts, evaluation)["balanced_accuracy"]

    def answer_confidence(self, model: HookedModel, prompts: PromptSet, evaluation: Evaluation) -> torch.Tensor:
        """How much the true-digit and true-carry probes believe the answer in ``evaluation`` [N]:
        the product over slots of the probability they give to its digits and carries, read with
        that answer fed back. Compares candidate answers to the same prompts (``repair``).

        Args:
            model: The hooked model the detector was fitted on.
            prompts: The prompts (N of them).
            evaluation: The candidate answers (an evaluation of ``prompts``).

        Returns:
            The confidence, float [N].

        Raises:
            NotFittedError: the detector is not fitted.
        """
        check_belongs(model, "ErrorDetector.answer_confidence", prompts=prompts, detector=self)
        self._check_fitted()
        X, evaluation = self._read(model, prompts, evaluation, self.layers_)
        slots, carries = self._labels(prompts, evaluation)
        return self.answer_confidence_activations(X, slots, carries)

    # -- files -----------------------------------------------------------------------------------

    def save(self, path: Union[str, Path], *, overwrite: bool = False) -> Path:
        """Write the fitted detector to a folder, sealed as a result is: tensors in safetensors with
        the fingerprint of the model it was fitted on, the rest in JSON with the tensors' sha256
        (:mod:`~arithinterp.probes.detector_files`; no pickle).

        Args:
            path: The folder, created when missing.
            overwrite: Replace a *different* saved detector or result in the folder.

        Returns:
            The folder.

        Raises:
            NotFittedError: the detector is not fitted.
            ConfigError: the folder is not writable, or the detector's probe is not one of this
                package's estimators (those are saved without pickle).
            ResultFileError: the folder holds something else and ``overwrite`` is false.
        """
        from arithinterp.probes.detector_files import save_detector

        self._check_fitted()
        return save_detector(self, path, overwrite)

    @classmethod
    def load(cls, path: Union[str, Path], model: Optional[HookedModel] = None) -> "ErrorDetector":
        """Read a detector :meth:`save` wrote; with ``model``, refuse it unless it was fitted on that
        model's weights (:meth:`on_model` declares it for another model on purpose). Without, every
        later use on a model checks the same.

        Args:
            path: The folder.
            model: The model it will be used on, checked now.

        Returns:
            The fitted detector.

        Raises:
            ResultFileError: the folder holds something else, is damaged or was changed after saving.
            ModelMismatchError: ``model`` is another model (another shape, or other weights).
        """
        from arithinterp.probes.detector_files import load_detector

        detector = load_detector(cls, path)
        if model is not None:
            try:
                check_belongs(model, "ErrorDetector.load", detector=detector)
            except ModelMismatchError as error:
                raise ModelMismatchError(f"{error} (or, to use it on this model on purpose, "
                                         "ErrorDetector.load(path).on_model(model))") from None
        return detector

    def on_model(self, model: HookedModel) -> "ErrorDetector":
        """This detector declared for use on ``model``, another model of the same shape (another
        checkpoint, a control with other weights): its ``meta_["fingerprint"]`` becomes ``model``'s,
        the one it was fitted on kept in ``meta_["made_on_fingerprint"]``.

        Args:
            model: The model to declare it for.

        Returns:
            The detector itself, declared.

        Raises:
            NotFittedError: the detector is not fitted.
            ModelMismatchError: ``model`` has another shape.
        """
        from types import SimpleNamespace

        self._check_fitted()
        made_on = self.meta_.get("made_on_fingerprint", self.meta_.get("fingerprint"))
        meta = {**self.meta_, "made_on_fingerprint": made_on, "fingerprint": fingerprint(model)}
        check_belongs(model, "ErrorDetector.on_model", detector=SimpleNamespace(meta=meta))  # the shape must fit
        self.meta_ = meta
        return self

    # -- tensor-facing ---------------------------------------------------------------------------

    def fit_activations(self, X: torch.Tensor, slots: dict, carries: Optional[dict] = None,
                        layers: Optional[Sequence[int]] = None) -> "ErrorDetector":
        """Fit from slot activations and their labels.

        With ``layers="auto"`` in the constructor the detector is fitted on each candidate set of
        layers (:meth:`layer_candidates`) and the best by out-of-fold AUROC is kept.

        Args:
            X: Slot activations [N, L, S, d].
            slots: :func:`answer_slots` labels (``true``, ``output``, ``valid`` [N, S], ``correct`` [N]).
            carries: :func:`answer_carries` labels, or ``None``.
            layers: The layers on axis 1 of ``X`` (default ``0..L-1``).

        Returns:
            The detector, fitted.

        Raises:
            ConfigError: a constructor argument is refused.
            AnalysisError: ``X`` and the labels disagree in shape, or too few right or wrong
                answers for ``cv`` folds.
        """
        return self._fit_activations(X, slots, carries, layers, time.perf_counter())

    def _fit_activations(self, X: torch.Tensor, slots: dict, carries: Optional[dict],
                         layers: Optional[Sequence[int]], started: float) -> "ErrorDetector":
        """:meth:`fit_activations`, its time limit counted from ``started``."""
        probe = check_params(self)
        X = check_slot_activations(X, slots)
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
        carries = check_carries(carries, slots) if self.carries else None
        distinct = sum(not any(torch.equal(X[:, 0, s], X[:, 0, t]) for t in range(s)) for s in range(X.shape[2]))
        candidates = self.layer_candidates(names, distinct, X.shape[3]) if self.layers == "auto" else [names]
        n_candidates = len(candidates)
        if self.max_seconds is not None or self.max_candidates is not None:  # a search that may stop early
            order = site_lib.coarse_to_fine(names)  # covers the depth first
            candidates.sort(key=lambda chosen: order.index(chosen[0]) if len(chosen) == 1 else len(order))
            candidates = candidates[: self.max_candidates]
        search, fitted = [], None
        for chosen in candidates:
            if search and self.max_seconds is not None and time.perf_counter() - started > self.max_seconds:
                break
            columns = [names.index(layer) for layer in chosen]
            detector = self if len(candidates) == 1 else clone_estimator(self).set_params(layers=list(chosen))
            fit_candidate(detector, probe, X[:, columns], slots, carries, chosen)
            row = selected_row(detector)
            search.append(dict(layers=list(chosen), method=detector.method_,
                               **{k: row[k] for k in ("auroc", "balanced_accuracy", "balanced_accuracy_low",
                                                      "accuracy", "majority_baseline")}))
            if fitted is None or rank(row) > rank(selected_row(fitted)):
                fitted = detector
        assert fitted is not None
        self.fit_layers_ = names  # what axis 1 held at fit: the tensor-facing methods take X like it, too
        if fitted is not self:  # keep the chosen candidate's fitted state
            for key, value in vars(fitted).items():
                if key.endswith("_") and not key.startswith("_"):
                    setattr(self, key, value)
        fit_meta(self, probe, carries is not None, n_wrong, len(correct), search, len(candidates) > 1)
        self.meta_["layer_candidates"] = n_candidates
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

    def predict_proba_activations(self, X: torch.Tensor, valid: Optional[torch.Tensor] = None,
                                  method: Optional[str] = None) -> torch.Tensor:
        """Calibrated P(correct) from slot activations.

        Args:
            X: Slot activations [N, L, S, d] of the fitted layers (or of every layer it was fitted from).
            valid: BoolTensor [N, S], the slots that exist; ``None``: all.
            method: One of :data:`DETECTOR_METHODS`; ``None`` is the selected one.

        Returns:
            P(correct), float [N].

        Raises:
            NotFittedError: the detector is not fitted.
            AnalysisError: ``X`` does not have the fitted shape.
        """
        return self._all_proba(X, valid)[method or self.method_]

    def flag_activations(self, X: torch.Tensor, valid: Optional[torch.Tensor] = None,
                         budget: Optional[float] = None) -> torch.Tensor:
        """Flags from slot activations (see :meth:`flag`).

        Args:
            X: Slot activations [N, L, S, d].
            valid: BoolTensor [N, S], the slots that exist; ``None``: all.
            budget: The fraction of prompts to flag, in (0, 1]; ``None`` uses the threshold.

        Returns:
            BoolTensor [N], True for a flagged prompt.
        """
        return self._flags(self.predict_proba_activations(X, valid), budget)

    def evaluate_activations(self, X: torch.Tensor, slots: dict, carries: Optional[dict] = None) -> "DetectorResult":
        """Metrics from slot activations and their labels.

        Args:
            X: Slot activations [N, L, S, d].
            slots: :func:`answer_slots` labels.
            carries: :func:`answer_carries` labels (unused: scores come from the fitted probes).

        Returns:
            Per-prompt scores and calls of every method, and the slot probes' predictions.

        Raises:
            NotFittedError: the detector is not fitted.
            AnalysisError: ``X`` and the labels disagree in shape.
        """
        self._check_fitted()
        X = self._chosen_layers(check_slot_activations(X, slots))
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
        """:meth:`answer_confidence` from activations read with the answer fed back.

        Args:
            X: Slot activations [N, L, S, d].
            slots: Labels of the answer (``slots["output"]`` is the answer's digits).
            carries: Carry labels of the answer (``carries["output"]``), or ``None``.

        Returns:
            The confidence, float [N].

        Raises:
            NotFittedError: the detector is not fitted.
        """
        self._check_fitted()
        X = self._chosen_layers(check_slot_activations(X, slots))
        Xs = X.permute(0, 2, 1, 3).flatten(2)
        confidence = torch.ones(len(X))
        for s, probes in enumerate(self.slot_probes_):
            p = likelihood(probes["true_digit"], self._truth_X(Xs, s), slots["output"][:, s])
            confidence *= torch.where(slots["valid"][:, s], p, 1.0)
            if "true_carry" in probes and carries is not None:
                p = likelihood(probes["true_carry"], self._truth_X(Xs, s), carries["output"][:, s])
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
        return budget_flags(proba, budget) if budget is not None else proba < self.thresholds_[self.method_]

    def _truth_X(self, Xs: torch.Tensor, s: int) -> torch.Tensor:
        """What the true-value probes of slot ``s`` read: the slot [N, L·d] or the answer [N, S'·L·d]."""
        return Xs[:, self.direct_slots_].flatten(1) if self.truth == "answer" else Xs[:, s]

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
                    agree[kind][:, s] = agreement(probes[f"true_{kind}"], probes[f"output_{kind}"],
                                                  Xd if self.truth == "answer" else Xs[:, s], Xs[:, s])
        direct = p_correct(self.direct_probe_, Xd)
        features, _ = method_features(agree, direct, valid, self.combined_columns_)
        return {m: torch.as_tensor(self.calibrators_[m].predict_proba(features[m])[:, 1]).float()
                for m in DETECTOR_METHODS}
