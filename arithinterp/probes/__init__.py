"""Linear probes, a probe per layer and position, and a probe-based error detector.

What is linearly readable where — operands, answer digits, carries, the model's *own* answer —
and can a probe tell, before an answer digit is emitted, that the model is about to get it wrong?
The probes, the circular digit probe, the output-digit / true-digit disagreement detector and the
"re-ask only what is flagged" use follow Sun, Stolfo & Sachan 2025; the held-out,
control-backed probing practice follows Kantamneni & Tegmark 2025 and Nikankin et al. 2025.

* ``estimators`` — probes as scikit-learn estimators (``fit(X, y)``, ``predict``, ``score``,
  ``get_params``; ``X`` is a torch tensor or numpy array ``[n_samples, n_features]``; features are
  standardised inside): :class:`LogisticProbe`, :class:`RidgeProbe`, :class:`CircularProbe`,
  :class:`MLPProbe`, and :func:`make_probe`. Fitted linear probes expose ``directions_``
  ``[k, n_features]`` (unit rows in the raw activation space) for patching and steering.
  :class:`LogisticProbe` lives in ``logistic``, its row-wise L-BFGS in ``lbfgs``, and the input
  validation and standardisation every probe shares in ``probe_base``.
* ``layer_probes`` — :func:`probe_layers`: k-fold held-out score per layer x position with 95% CIs
  (folds grouped by operand pair whenever a pair repeats; any scikit-learn estimator, cloned),
  directions fitted on all data, and controls (shuffled labels; a random-init model's
  activations) → :class:`ProbeResult` (``probe_result``), whose ``finding()`` names a finding
  only above chance and every control; :func:`probe_model` collects the model and a random-init
  copy and probes both (readable vs computed); targets via :func:`resolve_target` (``targets``),
  folds and per-cell scores in ``cross_validation``.
* ``answers`` — :func:`answer_activations`: activations at the position before each answer token,
  with the model's own answer teacher-forced; :func:`answer_slots`: each answer slot's values, and
  :func:`slot_names`: what each slot holds (a digit's place, or an answer token's position).
* ``detector`` — :class:`ErrorDetector` flags prompts the model will answer wrongly (digit and
  carry probes, several layers, calibrated, method and threshold chosen by cross-validation) →
  :class:`DetectorResult` (``detector_result``). It stands on ``slots`` (the model's answers
  generated once per prompt set, where each slot is read, :func:`answer_carries` for the carry
  labels), ``slot_probes`` (the slot probes and each method's features), ``detector_fit`` (the
  fit on one set of layers) and ``operating_points`` (:func:`detection_metrics`, thresholds,
  budgets).
* ``reask`` — :func:`repair` re-asks only flagged prompts and keeps a new answer only when the
  detector believes it more → :class:`RepairResult`.

Imports flow one way: ``probe_base`` ← ``lbfgs`` ← ``logistic`` ← ``estimators`` ← ``targets``,
``cross_validation`` ← ``probe_result`` ← ``layer_probes``;
``answers``, ``estimators`` ← ``slots``,
``slot_probes``, ``operating_points`` ← ``detector_fit``, ``detector_result`` ← ``detector`` ← ``reask``.
"""

from arithinterp.probes.answers import answer_activations, answer_slots, slot_names
from arithinterp.probes.detector import ErrorDetector
from arithinterp.probes.detector_fit import DetectorBaselineWarning
from arithinterp.probes.detector_result import DetectorResult
from arithinterp.probes.estimators import (
    PROBE_KINDS,
    CircularProbe,
    MLPProbe,
    RidgeProbe,
    is_classifier_kind,
    make_probe,
)
from arithinterp.probes.logistic import LogisticProbe
from arithinterp.probes.cross_validation import confidence_interval, resolve_groups
from arithinterp.probes.layer_probes import probe_layers, probe_model
from arithinterp.probes.probe_result import CONTROLS, ProbeResult
from arithinterp.probes.targets import resolve_target
from arithinterp.probes.probe_base import ArrayLike, NotFittedError
from arithinterp.probes.operating_points import (
    THRESHOLD_RULES,
    balanced_accuracy_interval,
    best_threshold,
    detection_metrics,
)
from arithinterp.probes.reask import RepairResult, few_shot_policy, repair, vote_policy
from arithinterp.probes.slot_probes import DETECTOR_METHODS
from arithinterp.probes.slots import DETECTOR_POSITIONS, answer_carries

__all__ = [
    "LogisticProbe",
    "RidgeProbe",
    "CircularProbe",
    "MLPProbe",
    "NotFittedError",
    "make_probe",
    "is_classifier_kind",
    "resolve_target",
    "resolve_groups",
    "confidence_interval",
    "probe_layers",
    "probe_model",
    "ProbeResult",
    "answer_activations",
    "answer_slots",
    "slot_names",
    "detection_metrics",
    "best_threshold",
    "balanced_accuracy_interval",
    "ErrorDetector",
    "DetectorResult",
    "DetectorBaselineWarning",
    "answer_carries",
    "few_shot_policy",
    "vote_policy",
    "repair",
    "RepairResult",
    "PROBE_KINDS",
    "CONTROLS",
    "DETECTOR_METHODS",
    "DETECTOR_POSITIONS",
    "THRESHOLD_RULES",
    "ArrayLike",
]
