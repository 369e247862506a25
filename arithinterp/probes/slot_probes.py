"""The error detector's slot probes, and how its three methods turn them into features.

Per answer slot, a probe reads the true digit and one the model's digit (and, for addition
written digit by digit, the carries); their agreement, and a direct correct-vs-wrong probe, are
the features each of :data:`DETECTOR_METHODS` calibrates into P(correct) (Sun, Stolfo & Sachan 2025).
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import numpy as np
import torch

from arithinterp.probes.estimators import CircularProbe
from arithinterp.probes.lbfgs import feature_eigenbasis
from arithinterp.probes.logistic import LogisticProbe
from arithinterp.probes.probe_base import clone_estimator

DETECTOR_METHODS = ("disagreement", "direct", "combined")


class Constant:
    """A target with a single value in its training rows: predicts it with certainty.

    Args:
        value: The one value (-1 where the target had no rows).
    """

    def __init__(self, value: int):
        self.classes_ = torch.tensor([value])

    def predict(self, X):
        """The value, once per row of ``X``.

        Args:
            X: Features [n, d].

        Returns:
            long [n].
        """
        return self.classes_.expand(len(X))

    def predict_proba(self, X):
        """Certainty, once per row of ``X``.

        Args:
            X: Features [n, d].

        Returns:
            [n, 1] of ones.
        """
        return torch.ones(len(X), 1)


def class_probs(probe: Any, X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A slot probe's class probabilities (a circular probe gives a soft one-hot).

    Args:
        probe: A fitted classifier, :class:`CircularProbe` or :class:`Constant`.
        X: Features [n, d].

    Returns:
        ``(probs [n, k], classes [k])``.
    """
    if isinstance(probe, CircularProbe):
        classes = torch.arange(probe.period)
        gap = probe.predict_angle(X)[:, None] - 2 * math.pi * classes[None] / probe.period
        return (probe.period * gap.cos()).softmax(-1), classes
    probs = torch.as_tensor(np.asarray(probe.predict_proba(X)), dtype=torch.float32)
    return probs, torch.as_tensor(np.asarray(probe.classes_)).long()


def likelihood(probe: Any, X: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Probability the probe gives to ``value`` (0 for a value it never saw).

    Args:
        probe: A fitted slot probe.
        X: Features [n, d].
        value: The value of each row, long [n].

    Returns:
        The probabilities, [n].
    """
    probs, classes = class_probs(probe, X)
    hit = (value[:, None] == classes[None, :]).float()
    return (probs * hit).sum(-1)


def p_correct(probe: Any, X: torch.Tensor) -> torch.Tensor:
    """The direct probe's probability of class 1 (correct).

    Args:
        probe: The fitted direct probe.
        X: Features [n, d].

    Returns:
        P(correct), [n].
    """
    probs, classes = class_probs(probe, X)
    return (probs * (classes == 1).float()[None, :]).sum(-1)


def agreement(true_probe: Any, output_probe: Any, X_truth: torch.Tensor, X_slot: torch.Tensor) -> torch.Tensor:
    """The probability that a slot's true-value and output-value probes name the same value.

    Args:
        true_probe: The true-value probe.
        output_probe: The output-value probe.
        X_truth: What the true-value probe reads: the slot, or every slot side by side [n, d'].
        X_slot: The slot's features [n, d].

    Returns:
        The agreement, [n].
    """
    p_true, c_true = class_probs(true_probe, X_truth)
    p_out, c_out = class_probs(output_probe, X_slot)
    return ((p_true @ (c_true[:, None] == c_out[None, :]).float()) * p_out).sum(-1)


def direct_probe(probe: Any) -> Any:
    """The direct correct-vs-wrong probe: a clone of ``probe``, class-balanced where it can be.

    Args:
        probe: The slot probe (a circular probe is replaced by ``LogisticProbe(C=0.05)``: an
            angle cannot tell two classes apart).

    Returns:
        An unfitted estimator.
    """
    if isinstance(probe, CircularProbe):  # an angle cannot tell two classes apart: a logistic probe does
        probe = LogisticProbe(C=0.05)
    probe = clone_estimator(probe)
    if "class_weight" in probe.get_params():
        probe.set_params(class_weight="balanced")
    return probe


def slot_targets(slots: dict, carries: Optional[dict]) -> list[list]:
    """Every probe target of every slot.

    Args:
        slots: :func:`~arithinterp.probes.answer_slots` labels (``true``, ``output``, ``valid`` [N, S]).
        carries: :func:`~arithinterp.probes.answer_carries` labels, or ``None``.

    Returns:
        Per slot, ``(name, labels [N], rows [N])`` for ``true_digit``, ``output_digit`` and, where
        the slot has carries, ``true_carry`` and ``output_carry``.
    """
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


def fit_problems(probe: Any, X: torch.Tensor, labels: torch.Tensor, masks: torch.Tensor) -> list:
    """One fitted clone of ``probe`` per row of ``labels`` / ``masks``, on the rows where the mask
    is True; a :class:`Constant` where only one value is present. Logistic probes are fitted as
    one block-separable problem (``LogisticProbe.fit_many``).

    Args:
        probe: The estimator to clone.
        X: Features [n, d].
        labels: [B, n], one target per row.
        masks: BoolTensor [B, n], the rows each target is fitted on.

    Returns:
        B fitted probes (or constants).
    """
    fitted: list = [None] * len(labels)
    todo = []
    for i in range(len(labels)):
        values = torch.unique(labels[i][masks[i]])
        if len(values) < 2:
            fitted[i] = Constant(int(values[0]) if len(values) else -1)
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


def fit_batched(probe: Any, problems: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> list[list]:
    """:func:`fit_problems` for many problems at once, for a :class:`LogisticProbe`.

    Every row of every problem with the same features and the same classes is fitted in one
    ``fit_many(solver="rows")`` call: each its own L-BFGS, one matrix product per step for all of
    them. (Folds are not started from the fit on every row: that fit has seen the fold's held-out
    rows, and a fold stopped before convergence would remember them.)

    Args:
        probe: The logistic probe to clone.
        problems: ``(features [n, d], labels [B, n], masks [B, n])`` per problem.

    Returns:
        One list of B fitted probes (or constants) per problem.
    """
    fitted: list[list] = [[None] * len(labels) for _, labels, _ in problems]
    groups: dict = {}  # (features, classes) -> [(problem, row)]
    for i, (features, labels, masks) in enumerate(problems):
        for b in range(len(labels)):
            values = torch.unique(labels[b][masks[b]])
            if len(values) < 2:
                fitted[i][b] = Constant(int(values[0]) if len(values) else -1)
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


def method_features(agree: dict, direct: torch.Tensor, valid: torch.Tensor,
                    columns: Optional[list[int]] = None) -> tuple[dict, list[int]]:
    """Each method's calibrator input.

    Args:
        agree: ``"digit"`` and ``"carry"`` agreements per slot, [N, S] each.
        direct: The direct probe's P(correct), [N].
        valid: BoolTensor [N, S], the slots that exist.
        columns: The ``combined`` columns kept; ``None`` (when fitting) keeps those that vary
            (a slot the model never gets wrong carries nothing).

    Returns:
        ``(features, columns)``: ``disagreement`` [N, 1] (log P(every slot agrees)), ``direct``
        [N, 1] (logit), ``combined`` [N, F] (per-slot log agreements and the logit), as numpy
        arrays, and the ``combined`` columns kept.
    """
    log_digit = torch.where(valid, agree["digit"].clamp_min(1e-6).log(), 0.0)
    log_carry = torch.where(valid, agree["carry"].clamp_min(1e-6).log(), 0.0)
    combined = torch.cat([log_digit, log_carry, _logit(direct)[:, None].float()], 1)
    if columns is None:  # columns that never vary (a slot the model never gets wrong) carry nothing
        columns = (combined.std(0) > 1e-6).nonzero()[:, 0].tolist()
    return dict(
        disagreement=log_digit.sum(1, keepdim=True).double().numpy(),
        direct=_logit(direct)[:, None].numpy(),
        combined=combined[:, columns].double().numpy(),
    ), columns
