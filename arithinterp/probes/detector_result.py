"""What an :class:`~arithinterp.probes.ErrorDetector` finds on a prompt set: :class:`DetectorResult`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from arithinterp.drawing import draw
from arithinterp.errors import ConfigError, accepted
from arithinterp.probes.operating_points import budget_flags, detection_metrics
from arithinterp.probes.slot_probes import DETECTOR_METHODS
from arithinterp.probes.slots import DETECTOR_POSITIONS
from arithinterp.results import NON_NEGATIVE, Result


@dataclass(frozen=True)
class DetectorResult(Result):
    """An :class:`ErrorDetector` on a prompt set: per-prompt scores and metrics for each method.

    ``correct`` [N] (the truth), ``scores`` [N, M] (calibrated P(correct) per method in
    ``methods``), ``predicted_correct`` [N, M] (at each method's threshold); per answer slot
    [N, S]: ``true_slots``, ``output_slots``, ``slot_valid`` and the slot probes' predictions
    ``pred_true_slots`` / ``pred_output_slots``, each slot named in :attr:`slot_names` (a digit's
    place, ``"tens"``, or an answer token's position, ``"answer[1]"``). ``method`` is the one ``flag`` uses;
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
            raise ConfigError(f"unknown method {method!r}; accepted: {accepted(self.methods)}")
        return self.methods.index(method)

    def metrics(self, method: Optional[str] = None) -> dict:
        """:func:`~arithinterp.probes.detection_metrics` for ``method``.

        Args:
            method: One of ``methods``; ``None`` is the selected one.

        Returns:
            The metrics by name.

        Raises:
            ConfigError: ``method`` is unknown.
        """
        m = self._index(method)
        return detection_metrics(self.correct, self.predicted_correct[:, m], self.scores[:, m])

    def at_budget(self, budget: float = 0.1, method: Optional[str] = None) -> dict:
        """Flag the riskiest ``ceil(budget · N)`` prompts: how many, and the error precision
        (flags that are errors) and recall (errors flagged) at that operating point.

        Args:
            budget: The fraction of prompts flagged, in (0, 1].
            method: One of ``methods``; ``None`` is the selected one.

        Returns:
            ``budget``, ``flagged``, ``error_precision`` and ``error_recall``.

        Raises:
            ConfigError: ``method`` is unknown.
            ConfigError: ``budget`` is not a fraction in (0, 1].
        """
        m = self._index(method)
        flags = budget_flags(self.scores[:, m], budget)
        wrong = ~self.correct
        return dict(budget=budget, flagged=int(flags.sum()),
                    error_precision=float((flags & wrong).sum() / max(int(flags.sum()), 1)),
                    error_recall=float((flags & wrong).sum() / max(int(wrong.sum()), 1)))

    def __getitem__(self, key: str) -> float:
        """A metric of the selected method, e.g. ``result["auroc"]``.

        Args:
            key: A metric's name (see :meth:`metrics`).

        Returns:
            Its value.

        Raises:
            ConfigError: ``key`` is not a metric.
        """
        values = self.metrics()
        if key not in values:
            raise ConfigError(f"unknown metric {key!r}; accepted: {accepted(values)}")
        return values[key]

    def headline(self) -> dict:
        """The selected method's verdict and scores (:meth:`finding`).

        Returns:
            ``verdict``, ``balanced_accuracy``, ``auroc``, ``accuracy`` and ``majority_baseline``.
        """
        found = self.finding()
        return {key: found[key] for key in ("verdict", "balanced_accuracy", "auroc", "accuracy", "majority_baseline")}

    def finding(self, method: Optional[str] = None) -> dict:
        """The detector's result in words and numbers, against always answering one way.

        ``verdict`` is ``"finding"`` when balanced accuracy's 95% interval lies above 0.5 (what
        always answering "correct" or always "wrong" scores, whatever the error rate), else
        ``"no signal"``. ``text`` quotes balanced accuracy with its interval, AUROC, accuracy
        against the majority outcome's, the layers read and, from the fit, every layer set tried
        (compared out of fold on the fitting prompts) and the positions read.

        Args:
            method: One of ``methods``; ``None`` is the selected one.

        Returns:
            ``verdict``, ``text``, the balanced accuracy with ``ci_low`` / ``ci_high``, ``auroc``,
            ``accuracy``, ``majority_baseline``, ``layers``, ``layers_tried`` and ``positions``.

        Raises:
            ConfigError: ``method`` is unknown.
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

    @property
    def slot_names(self) -> list[str]:
        """What each slot holds (:func:`~arithinterp.probes.answers.slot_names`): a digit's place
        (``"units"``, ``"tens"``, ...) or, where answer token ``j`` is not the same place in every
        prompt, its position ``"answer[j]"``; ``"slot 0"``, ``"slot 1"``, ... for a result computed
        from activations alone (``evaluate_activations`` of a detector fitted on activations)."""
        names, n = self.meta.get("slots"), self.true_slots.shape[1]
        return list(names) if names is not None and len(names) == n else [f"slot {s}" for s in range(n)]

    def slot_accuracy(self) -> dict:
        """Held-out accuracy of the true-digit and output-digit probes per slot.

        Returns:
            ``{"slot": [S names], "true": [S floats], "output": [S floats]}``.
        """
        valid = self.slot_valid.float()
        hit_true = ((self.pred_true_slots == self.true_slots).float() * valid).sum(0) / valid.sum(0).clamp_min(1)
        hit_out = ((self.pred_output_slots == self.output_slots).float() * valid).sum(0) / valid.sum(0).clamp_min(1)
        return dict(slot=self.slot_names, true=hit_true.tolist(), output=hit_out.tolist())

    def to_frame(self, budget: float = 0.1):
        """One row per method: its metrics and the error precision / recall at ``budget``.

        Args:
            budget: The fraction of prompts flagged for the ``*_at_budget`` columns.

        Returns:
            A pandas DataFrame, one row per method.
        """
        import pandas as pd

        rows = []
        for m in self.methods:
            at = self.at_budget(budget, m)
            rows.append(dict(method=m, selected=m == self.method, layers=",".join(map(str, self.layers)),
                             position=self.position, **self.metrics(m),
                             budget=budget, error_precision_at_budget=at["error_precision"],
                             error_recall_at_budget=at["error_recall"]))
        return pd.DataFrame(rows)

    def plot(self, kind: str = "roc", digit: Optional[str] = None, probe: str = "true", **kwargs):
        """``kind="roc"``: ROC curve per method; ``"calibration"``: reliability diagram (predicted
        P(correct) vs observed frequency); ``"confusion"``: predicted vs actual values of the
        ``probe`` (``"true"`` or ``"output"``) digit probe of one answer digit.

        Args:
            kind: ``"roc"``, ``"calibration"`` or ``"confusion"``.
            digit: The confusion matrix's digit, one of :attr:`slot_names` (``"tens"``;
                ``None``: the first).
            probe: ``"true"`` or ``"output"``, the confusion matrix's probe.
            **kwargs: Passed to the :mod:`arithinterp.viz.probes` builder.

        Returns:
            A plotly Figure.

        Raises:
            ConfigError: ``kind`` or ``probe`` is unknown.
        """
        return draw(self, kind=kind, digit=digit, probe=probe, **kwargs)
